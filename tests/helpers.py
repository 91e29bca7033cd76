"""Shared test helpers (a module, not conftest, so test folders can't shadow it)."""
import importlib.util
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


def _bench_helpers():
    """bench/pinned_pair.py, loaded by path (bench/ is no package, and putting it on
    sys.path would let its script names shadow modules)."""
    spec = importlib.util.spec_from_file_location("bench_pinned_pair", ROOT / "bench" / "pinned_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the environment of a process a test launches: the benches' own (the tree before the
# caller's PYTHONPATH, where the dependencies may be installed)
_BENCH = _bench_helpers()
pythonpath, repo_env = _BENCH.pythonpath, _BENCH.repo_env


def free_port() -> int:
    """A TCP port free on the loopback address now (for a rendezvous a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_cluster(workers: int = 2, cpus: int = 1, **network) -> dict:
    speeds = [1.0, 0.5, 1.0, 0.5]
    return {
        "name": "test",
        "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": speeds[i % 4]}} for i in range(workers)]
        + [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)],
        **({"network": network} if network else {}),
    }


# PyTorch's own exit race (hetrain/runtime/settle.py says how it comes about): a process
# of a plain PyTorch script, run by plain torchrun or python, can abort after its last
# line when a gloo thread still releases its last collective as the interpreter
# finalises. hetrain's launcher and processes settle those threads first; a reference
# run of plain PyTorch cannot, so it is accepted with this abort once every process
# printed its result.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def plain_reference_finished(returncode: int, output: str, results: int, expected: int) -> bool:
    """Whether a plain PyTorch reference run finished its work: exit 0, or only PyTorch's
    exit race (above) after all `expected` processes printed a result."""
    if returncode == 0:
        return True
    return GLOO_EXIT_ABORT in output and results == expected
