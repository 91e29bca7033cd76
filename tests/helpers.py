"""Shared test helpers (a module, not conftest, so test folders can't shadow it)."""
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def small_cluster(workers: int = 2, cpus: int = 1, **network) -> dict:
    speeds = [1.0, 0.5, 1.0, 0.5]
    return {
        "name": "test",
        "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": speeds[i % 4]}} for i in range(workers)]
        + [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)],
        **({"network": network} if network else {}),
    }
