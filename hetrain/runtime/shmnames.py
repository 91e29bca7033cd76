"""Names, admission tokens and cleanup of a job's shared-memory segments, and which
processes share a host.

The shared-memory data plane (hetrain/comm/shm/) keeps its segments as files in
/dev/shm. They live here, in runtime/, because the launcher removes a job's segments
when the job ends and the launcher never imports comm/.

- A segment's name carries the job id and an HMAC of the job secret over its key, so
  another job (or anyone without the secret) cannot even compute it:
  ``hetrain-shm-<job>-<key>-<hmac16>``.
- Its header holds a token, HMAC(secret, name), that an attaching process checks
  before it uses the segment (`token`), and the file is created with mode 0600.
- `remove_job_segments` unlinks every segment of a job; the launcher calls it when the
  job ends, so even a segment whose owner was SIGKILLed before it could unlink it is
  gone (the processes unlink their names as soon as every member has attached, so in
  a running job nothing is normally left to remove).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "hetrain-shm-"
TOKEN_BYTES = 32


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)[:40]


def segment_name(job_id: str, secret: str, key: str) -> str:
    """The file name in /dev/shm of the segment `key` (e.g. round, group and rank) of a job."""
    mac = hmac.new(secret.encode(), f"{job_id}|{key}".encode(), hashlib.sha256).hexdigest()[:16]
    return f"{PREFIX}{_safe(job_id)}-{_safe(key)}-{mac}"


def token(secret: str, name: str) -> bytes:
    """What the segment `name`'s header holds: proof that its creator had the secret,
    checked (constant time) by whoever attaches before anything is read or written."""
    return hmac.new(secret.encode(), f"segment|{name}".encode(), hashlib.sha256).digest()


def job_segments(job_id: str) -> list[Path]:
    """The job's segments still in /dev/shm."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(SHM_DIR.glob(f"{PREFIX}{_safe(job_id)}-*"))


def remove_job_segments(job_id: str) -> int:
    """Unlink every segment of the job (the launcher, at the end of the job); returns how
    many were left behind (by a process killed before it unlinked its own)."""
    n = 0
    for path in job_segments(job_id):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def host_of(proc, emulate: str) -> tuple:
    """The host a process runs on, as the launcher lays the job out: its node, and where
    links between machines are emulated (network namespaces or rate limits: each
    machine stands for a host of its own) its machine too. Processes with equal keys
    share memory; without emulation, the machines of one node are one host."""
    machine = proc.machine
    return (machine.node,) if emulate == "none" else (machine.node, machine.name)


def same_host(topology, cluster, ranks) -> bool:
    """Whether every rank in `ranks` runs on one host (see `host_of`)."""
    emulate = cluster.network.emulate if cluster is not None else "none"
    return len({host_of(topology.proc(r), emulate) for r in ranks}) == 1
