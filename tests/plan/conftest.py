import numpy as np
import pytest

from hetrain.perf.pipeline import Workload


def random_workload(rng: np.random.Generator, L: int, R: int, tight: bool = False) -> Workload:
    """A random small instance; `tight` makes counts small so availability binds."""
    compute = rng.uniform(1e-4, 5e-3, size=(L, R))
    return Workload(
        compute=compute,
        act_bytes=rng.uniform(1e3, 1e6, L),
        dense_param_bytes=rng.choice([0.0, 1e5, 1e6, 5e7], L),
        sparse_param_bytes=rng.choice([0.0, 0.0, 1e9, 8e9], L),
        price=rng.uniform(0.2, 4.0, R),
        count=rng.integers(1, 4 if tight else 40, R).astype(float),
        memory=rng.choice([4e9, 16e9, 64e9], R),
        bandwidth=rng.choice([2.5e8, 1.25e9, 3e9], R),
        type_names=tuple(f"t{r}" for r in range(R)),
        type_kinds=tuple("gpu" if r % 2 == 0 else "cpu" for r in range(R)),
    )


@pytest.fixture
def tiny_catalogue_dict():
    return {
        "name": "tiny",
        "types": [
            {"name": "gpu-a", "class": "gpu", "price_per_hour": 2.0, "count": 4, "memory": "16GiB",
             "bandwidth": "10gbit", "speed": {"dense": 20, "memory": 8, "sparse": 1}},
            {"name": "cpu-a", "class": "cpu", "price_per_hour": 0.5, "count": 16, "memory": "64GiB",
             "bandwidth": "10gbit", "speed": {"dense": 2, "memory": 2, "sparse": 3}},
        ],
    }
