"""The environment contract between the launcher and the processes it starts.

The launcher sets these; `hetrain.init()` reads them. torchrun's variables are set
too (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so
code written for torchrun keeps working inside a hetrain job. They count processes, as
torch.distributed does: RANK/WORLD_SIZE span every process of the job's process group
(workers are ranks 0..n-1, summation servers follow), LOCAL_RANK/LOCAL_WORLD_SIZE the
processes one launcher starts on its host, workers first (so a worker's LOCAL_RANK
is its index among the host's workers, the GPU index on a multi-GPU host).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Literal

PREFIX = "HETRAIN_"


@dataclass(frozen=True)
class CommConfig:
    """How push_pull moves gradients. Validated here so a bad flag fails at launch."""

    mode: str = "byteps"
    partition_bytes: int = 4_096_000  # BytePS default
    credit_bytes: int = 0  # bytes in flight per worker over all servers; 0 = a window per server (engine.window_partitions)
    timeout_s: float = 60.0  # a lost peer is reported within this time
    # parallel connections per server, ∝ its share; 1 (one per pair) measured as fast or
    # faster on tc-emulated links (bench/results/comm-full.txt, byteps vs byteps-1lane)
    max_lanes: int = 1
    codec: str = "fp32"  # gradient codec: fp32, fp16, int8, int4 or auto (by link bandwidth and tensor size)
    codec_rules: tuple[str, ...] = ()  # per-tensor overrides, NAME_GLOB=CODEC, first match wins
    overlap: bool = False  # push each gradient as soon as backward produces it
    sync: str = "sync"  # sync (default), async, or stale (bounded staleness, bound `staleness`)
    staleness: int = 0  # stale: the fastest worker is at most this many steps ahead of the slowest

    def __post_init__(self) -> None:
        from ..errors import UserError
        from .topology import MODES

        if self.mode not in MODES:
            raise UserError(f"unknown communication mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.partition_bytes < 1024:
            raise UserError(f"partition_bytes={self.partition_bytes} is too small; use at least 1024 (BytePS uses 4096000)")
        if self.credit_bytes < 0:
            raise UserError("credit_bytes must be >= 0 (0 picks a default)")
        if self.timeout_s <= 0:
            raise UserError("timeout_s must be positive")
        if not 1 <= self.max_lanes <= 16:
            raise UserError(f"max_lanes={self.max_lanes} must be between 1 and 16")
        from ..comm.compress import CODECS, parse_rules

        object.__setattr__(self, "codec_rules", tuple(self.codec_rules))
        if self.codec not in CODECS + ("auto",):
            raise UserError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODECS + ('auto',))}")
        parse_rules(self.codec_rules)
        if self.sync not in ("sync", "async", "stale"):
            raise UserError(f"unknown training mode sync={self.sync!r}; choose sync, async or stale")
        if self.staleness < 0:
            raise UserError(f"staleness bound must be >= 0 steps, got {self.staleness}")
        if self.sync != "sync" and self.mode == "allreduce":
            raise UserError(f"sync={self.sync} needs parameter servers that hold the parameters; "
                            "use mode ps, byteps or colocated")
        if self.sync != "sync" and (self.codec != "fp32" or self.codec_rules):
            raise UserError(f"codecs are available in synchronous training only; drop --codec or use sync={self.sync!r} "
                            "with fp32")
        if self.mode == "allreduce" and (self.codec != "fp32" or self.codec_rules):
            raise UserError("gradient codecs need summation servers to decode and add what workers send; "
                            "use mode byteps, ps or colocated, or codec fp32 with mode allreduce")


@dataclass(frozen=True)
class ProcEnv:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    job_id: str
    cluster_json: str
    comm: CommConfig = field(default_factory=CommConfig)
    run_dir: str = "runs/latest"
    local_rank: int = 0  # index among the processes this host runs (workers first)
    local_world_size: int = 1
    # who started the process: hetrain's launcher, or plain torchrun (runtime/torchrun.py:
    # workers only, its store, no job secret)
    origin: Literal["hetrain", "torchrun"] = "hetrain"

    def to_environ(self, secret: str) -> dict[str, str]:
        env = {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            f"{PREFIX}RANK": str(self.rank), f"{PREFIX}WORLD_SIZE": str(self.world_size),
            f"{PREFIX}MASTER_ADDR": self.master_addr, f"{PREFIX}MASTER_PORT": str(self.master_port),
            f"{PREFIX}JOB_ID": self.job_id, f"{PREFIX}CLUSTER": self.cluster_json,
            f"{PREFIX}COMM": json.dumps(asdict(self.comm)), f"{PREFIX}RUN_DIR": self.run_dir,
            f"{PREFIX}SECRET": secret,
        }
        return env

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> "ProcEnv | None":
        e = os.environ if environ is None else environ
        if f"{PREFIX}RANK" not in e:
            return None
        return cls(
            rank=int(e[f"{PREFIX}RANK"]), world_size=int(e[f"{PREFIX}WORLD_SIZE"]),
            master_addr=e[f"{PREFIX}MASTER_ADDR"], master_port=int(e[f"{PREFIX}MASTER_PORT"]),
            job_id=e[f"{PREFIX}JOB_ID"], cluster_json=e[f"{PREFIX}CLUSTER"],
            comm=CommConfig(**json.loads(e.get(f"{PREFIX}COMM", "{}"))),
            run_dir=e.get(f"{PREFIX}RUN_DIR", "runs/latest"),
            local_rank=int(e.get("LOCAL_RANK", "0")), local_world_size=int(e.get("LOCAL_WORLD_SIZE", "1")),
        )
