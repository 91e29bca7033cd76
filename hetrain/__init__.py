"""hetrain: fast, cheap PyTorch training on heterogeneous clusters."""
