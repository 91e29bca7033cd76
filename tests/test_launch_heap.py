"""`--heap`: what the launcher tells a process about its C heap, and that glibc acts on it.

- "keep" (the default) sets glibc's mmap and trim thresholds, "system" sets nothing, and a
  variable already in the launcher's environment (or the config's extra variables) wins;
- a bad policy is refused with the choices;
- a real child process given the "keep" variables, once warm, reuses a re-allocated 40 MB
  block without faulting it in again, where glibc's defaults fault it in on every
  allocation (page faults counted by the kernel, not times)."""
import platform
import subprocess
import sys

import pytest

from hetrain.cluster.spec import parse_cluster
from hetrain.errors import UserError
from hetrain.runtime.env import CommConfig
from hetrain.runtime.launch import LaunchConfig, process_env
from hetrain.runtime.launch.heap import KEEP_ENV, heap_env
from hetrain.runtime.topology import build_topology

CLUSTER = {"machines": [{"name": f"c{i}", "role": "worker", "device": {"kind": "cpu"}} for i in range(2)]}


def _env(cfg: LaunchConfig) -> dict[str, str]:
    topo = build_topology(cfg.cluster, cfg.comm.mode)
    return process_env(cfg, topo.proc(0), topo, cfg.cluster, "127.0.0.1", 1, "job", "s", "/tmp/run")


def _cfg(**kw) -> LaunchConfig:
    return LaunchConfig(parse_cluster(CLUSTER), ["train.py"], CommConfig(mode="allreduce"), **kw)


def test_keep_sets_both_thresholds_and_system_sets_none(monkeypatch):
    for k in KEEP_ENV:
        monkeypatch.delenv(k, raising=False)
    env = _env(_cfg())
    assert {k: env[k] for k in KEEP_ENV} == {"MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                                              "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    assert not set(KEEP_ENV) & set(_env(_cfg(heap="system")))


def test_the_users_own_tuning_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = _env(_cfg())
    assert "MALLOC_TRIM_THRESHOLD_" not in env  # the launcher's environment passes it on unchanged
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(1 << 30)
    env = _env(_cfg(extra_env={"MALLOC_MMAP_THRESHOLD_": "65536"}))
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert heap_env("keep", {"MALLOC_MMAP_THRESHOLD_": "1"}) == {"MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(UserError, match="keep, system"):
        _cfg(heap="forever")


CHILD = """
import resource, sys
import torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # 40 MB allocated and freed, as warm-up steps would
    torch.ones(10 << 20)
before = faults()
for _ in range(10):
    torch.ones(10 << 20)
print(faults() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the variables are glibc's; other C libraries "
                                                              "ignore them")
def test_a_process_told_to_keep_its_heap_stops_faulting_a_reused_block_in():
    def faults(extra: dict[str, str]) -> int:
        env = {k: v for k, v in __import__("os").environ.items() if k not in KEEP_ENV}
        out = subprocess.run([sys.executable, "-c", CHILD], env={**env, **extra}, capture_output=True, text=True,
                             timeout=120, check=True)
        return int(out.stdout.strip())

    pages = 10 * (40 << 20) // 4096  # every page of the ten blocks, were each faulted in anew
    system, keep = faults({}), faults(heap_env("keep", {}))
    assert system > pages // 2, system  # glibc's default: a fresh mapping each time
    assert keep < pages // 20, keep
