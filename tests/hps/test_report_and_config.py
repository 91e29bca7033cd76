"""`hetrain report` draws PNGs from a run's steps; config mistakes fail with a clear message."""
import json
import subprocess
import sys

import pytest

from hetrain.cluster.device import DeviceMemoryError, EmulatedDevice
from hetrain.cluster.spec import DeviceSpec
from hetrain.errors import UserError
from hetrain.runtime.env import CommConfig
from tests.helpers import pythonpath

# a bare environment (no caller's variables but PATH), with this tree and the caller's
# PYTHONPATH, where the dependencies may be installed (tests/helpers.py `repo_env`)
MINIMAL_ENV = {"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"}


def test_report_draws_pngs(tmp_path):
    with (tmp_path / "steps.jsonl").open("w") as fh:
        for step in range(8):
            ranks = {f"w{i}": {"samples": 10 + i * step, "compute_s": 0.1, "comm_s": 0.02, "wait_s": 0.01 * i,
                               "hidden_s": 0.01, "bytes": 1000 * (i + 1)} for i in range(3)}
            fh.write(json.dumps({"step": step, "ranks": ranks}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "hetrain.cli", "report", str(tmp_path)], capture_output=True,
                          text=True, env=MINIMAL_ENV)
    assert proc.returncode == 0, proc.stderr
    for name in ("shares.png", "time_split.png", "bytes.png"):
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_report_without_steps_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hetrain.cli", "report", str(tmp_path)], capture_output=True,
                          text=True, env=MINIMAL_ENV)
    assert proc.returncode == 2 and "steps.jsonl does not exist" in proc.stderr


@pytest.mark.parametrize("kwargs, msg", [
    ({"codec": "int3"}, "unknown codec 'int3'"),
    ({"mode": "allreduce", "codec": "int8"}, "need summation servers"),
    ({"codec_rules": ("bias:fp16",)}, "NAME_GLOB=CODEC"),
    ({"sync": "hogwild"}, "choose sync, async or stale"),
    ({"sync": "async", "mode": "allreduce"}, "parameter servers"),
    ({"sync": "stale", "staleness": -1}, "staleness bound must be >= 0"),
])
def test_comm_config_errors(kwargs, msg):
    with pytest.raises(UserError, match=msg):
        CommConfig(**kwargs)


def test_device_refuses_batch_over_memory_cap():
    dev = EmulatedDevice(DeviceSpec(memory="1MiB"), "w3")
    dev.check_memory(16, 2**16)
    with pytest.raises(DeviceMemoryError, match="machine w3: a batch of 17 samples needs 1.1 MiB but the device has 1.0"):
        dev.check_memory(17, 2**16)
