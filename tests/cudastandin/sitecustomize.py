"""Installs the CUDA stand-in (standin.py) at interpreter start in processes a test
launches with this folder first on PYTHONPATH and HETRAIN_TEST_CUDA_STANDIN set."""
import os

if os.environ.get("HETRAIN_TEST_CUDA_STANDIN"):
    import standin

    standin.install_from_environ()
