"""gloo's socket thread policy (runtime/commthreads.py): which threads it finds, what each
policy does to them, and the flag's validation. The gloo group is made in a child process
(one rank, a real gloo group and its real loop thread), so this test process keeps no
process group."""
import json
import os
import subprocess
import sys

import pytest

from hetrain.errors import UserError
from hetrain.runtime.commthreads import compute_fills_cores, lowers, loop_threads
from hetrain.runtime.env import CommConfig
from tests.helpers import repo_env

# the policy reads thread names from /proc and sets SCHED_IDLE, both Linux's; elsewhere it
# lowers nothing (commthreads.py) and there is nothing to check
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="thread names and SCHED_IDLE are Linux-only")

CHILD = r"""
import json, os, sys, torch, torch.distributed as dist
from hetrain.runtime.commthreads import configure, loop_threads, yield_loop_threads, yielding
policy, on_host, own = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
torch.set_num_threads(len(os.sched_getaffinity(0)))  # compute fills the cores
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
dist.new_group([0], backend="gloo")  # a second group: a second loop thread
import time
deadline = time.monotonic() + 10  # each loop thread names itself once it runs: wait for that, bounded
while len(loop_threads()) < 2 and time.monotonic() < deadline:
    time.sleep(0.005)
assert len(loop_threads()) >= 2, "gloo's loop threads did not name themselves within 10 s"
lowered = configure(policy, on_host, own)
again = yield_loop_threads()  # threads lowered before are skipped
tids = loop_threads()
x = torch.ones(4)
dist.all_reduce(x)  # a lowered thread still serves collectives
print("SEEN " + json.dumps({"lowered": lowered, "again": again, "threads": len(tids), "x": x.tolist(),
                            "yielding": yielding(),
                            "idle": [os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids]}))
dist.destroy_process_group()
"""


def _child(policy: str, on_host: bool = True, own_cores: bool = True) -> dict:
    env = repo_env(GLOO_SOCKET_IFNAME="lo")
    flags = ["1" if on_host else "0", "1" if own_cores else "0"]
    proc = subprocess.run([sys.executable, "-c", CHILD, policy, *flags], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN ")]
    return json.loads(line[5:])


@linux_only
def test_idle_lowers_every_gloo_loop_thread_and_collectives_still_run():
    seen = _child("idle")
    assert seen["threads"] >= 2  # one per gloo group
    assert seen["lowered"] == seen["threads"] and seen["again"] == 0
    assert all(seen["idle"]) and seen["yielding"]
    assert seen["x"] == [1.0] * 4


@linux_only
def test_normal_and_auto_without_cores_of_its_own_leave_the_threads_as_gloo_started_them():
    for policy, on_host, own in (("normal", True, True), ("auto", False, True), ("auto", True, False)):
        seen = _child(policy, on_host, own)
        assert seen["threads"] >= 2
        assert seen["lowered"] == 0 and not seen["yielding"]
        assert not any(seen["idle"])


@linux_only
def test_auto_lowers_a_host_worker_on_cores_of_its_own_that_compute_fills():
    seen = _child("auto", True, True)  # the child runs as many torch threads as it has cores
    assert seen["lowered"] == seen["threads"] >= 2


@linux_only
def test_the_policy_table(monkeypatch):
    """auto needs all four: an all-reduce job, compute on the host, cores of its own,
    torch threads filling them; idle and normal ignore them."""
    import torch

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert compute_fills_cores()
    assert lowers("auto", on_host=True, own_cores=True)
    assert not lowers("auto", on_host=False, own_cores=True)
    assert not lowers("auto", on_host=True, own_cores=False)
    assert not lowers("auto", on_host=True, own_cores=True, all_reduce=False)  # servers feed it mid-backward
    assert lowers("idle", on_host=False, own_cores=False)
    assert not lowers("normal", on_host=True, own_cores=True)
    if cores > 1:
        monkeypatch.setattr(torch, "get_num_threads", lambda: cores - 1)
        assert not compute_fills_cores()
        assert not lowers("auto", on_host=True, own_cores=True)


@linux_only
def test_loop_threads_finds_threads_by_their_kernel_name():
    """A thread that names itself (prctl PR_SET_NAME, as gloo's loop does) is found by
    that name, and only it."""
    import ctypes
    import threading

    named, done = threading.Event(), threading.Event()
    tid = []

    def probe():
        ctypes.CDLL(None).prctl(15, b"hetrain_probe", 0, 0, 0)  # PR_SET_NAME
        tid.append(threading.get_native_id())
        named.set()
        done.wait(30)

    t = threading.Thread(target=probe)
    t.start()
    try:
        assert named.wait(30)
        assert loop_threads("hetrain_probe") == tid
        assert loop_threads("hetrain_other") == []
    finally:
        done.set()
        t.join()


def test_a_bad_policy_names_the_flag():
    with pytest.raises(UserError, match="--gloo-thread"):
        CommConfig(gloo_thread="fast")
