import pytest

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.gavel import default_data_dir

DATA = default_data_dir()


@pytest.fixture
def gavel_dir():
    if not (DATA / "simulation_throughputs.json").is_file():
        pytest.fail(f"Gavel data not found at {DATA}: the package data hetrain/data/gavel is missing")
    return DATA


@pytest.fixture
def hetero():
    return parse_cluster_spec("v100:4,p100:4,k80:4")
