"""The environment contract between the launcher and the processes it starts.

The launcher sets these; `hetrain.init()` reads them. torchrun's variables are set
too (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so
code written for torchrun keeps working inside a hetrain job. They count processes, as
torch.distributed does: RANK/WORLD_SIZE span every process of the job's process group
(workers are ranks 0..n-1, summation servers follow), LOCAL_RANK/LOCAL_WORLD_SIZE the
processes one launcher starts on its host, workers first (so a worker's LOCAL_RANK
is its index among the host's workers), except that a CUDA worker's LOCAL_RANK is the GPU
it is bound to (runtime/devices.py: `device.index` + its index among its *machine's*
workers), so `torch.cuda.set_device(LOCAL_RANK)` agrees with hetrain's binding. The
launcher sets the rest of torchrun's agent variables too (`torchrun.agent_environ`).

The job's communication settings (`CommConfig`) are validated here, at launch, so a bad
flag fails before any process starts. Their words (mode, sync, codec) are the enums of
hetrain/modes.py; the facts the rest of the job acts on (`has_servers`, `synchronous`,
`coded`, `bound`) are decided here, once, on the parsed settings.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ..errors import UserError
from ..modes import Codec, CodecChoice, Mode, Sync

PREFIX = "HETRAIN_"
PLAN_ENV = "HETRAIN_PLAN"  # set by `hetrain launch --plan/--auto`: the plan file the job runs
PROFILE_STEPS_ENV = "HETRAIN_PROFILE_STEPS"  # `hetrain launch --auto`'s profiling round: stop after N steps

Collective = Literal["auto", "gloo", "nccl"]
Buckets = Literal["tuned", "ddp"]
GlooThread = Literal["auto", "idle", "normal"]
# a worker and a summation server on one host: shared memory (auto) or gloo over loopback
ServerLink = Literal["auto", "gloo"]
CODECS: tuple[str, ...] = tuple(c.value for c in Codec)
CODEC_CHOICES: tuple[str, ...] = tuple(c.value for c in CodecChoice)

# the command-line flag behind each field, so every error names what the user typed
FLAGS = {"mode": "--mode", "partition_bytes": "--partition-bytes", "credit_bytes": "--credit-bytes",
         "timeout_s": "--timeout", "max_lanes": "--max-lanes", "codec": "--codec", "codec_rules": "--codec-rule",
         "overlap": "--overlap", "sync": "--sync", "staleness": "--staleness", "collective": "--collective",
         "buckets": "--buckets", "gloo_thread": "--gloo-thread", "server_link": "--server-link"}
_WHAT = {"mode": "communication mode", "codec": "codec", "sync": "training mode", "collective": "collective backend",
         "buckets": "bucket policy", "gloo_thread": "gloo thread policy", "server_link": "server link"}


def parse_rules(rules: tuple[str, ...] | list[str]) -> list[tuple[str, CodecChoice]]:
    """`NAME_GLOB=CODEC` rules, e.g. `*.bias=fp32`; the first match wins."""
    out = []
    for r in rules:
        pattern, sep, codec = r.partition("=")
        if not sep or not pattern or codec not in CODEC_CHOICES:
            raise UserError(f"codec rule {r!r} must look like NAME_GLOB=CODEC with CODEC one of "
                            f"{', '.join(CODEC_CHOICES)} (e.g. '*.bias=fp32')")
        out.append((pattern, CodecChoice(codec)))
    return out


def _choices(options: tuple[str, ...]) -> str:
    return ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]


def _explain(err: ValidationError) -> str:
    """One message per bad field, naming the flag (pydantic's own wording says neither)."""
    lines = []
    for e in err.errors():
        name = str(e["loc"][0]) if e["loc"] else ""
        flag = FLAGS.get(name, name)
        if e["type"] in ("literal_error", "enum"):
            options = tuple(o.strip().strip("'") for o in e["ctx"]["expected"].replace(" or ", ", ").split(", "))
            lines.append(f"unknown {_WHAT.get(name, name)} {e['input']!r} ({flag}); choose {_choices(options)}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"unknown setting {name!r}; known: {', '.join(FLAGS)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if name == "" or flag in msg else f"{flag}: {msg}")
    return "; ".join(lines)


class CommConfig(BaseModel):
    """How push_pull moves gradients. Validated here so a bad flag fails at launch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Mode.BYTEPS
    partition_bytes: int = 4_096_000  # BytePS default
    credit_bytes: int = 0  # bytes in flight per worker over all servers; 0 = a window per server (comm.window)
    timeout_s: float = 60.0  # a lost peer (dead, or silent: no heartbeat) is reported within this time
    # parallel connections per server, ∝ its share; 1 (one per pair) measured as fast or
    # faster on tc-emulated links (bench/results/comm-full.txt, byteps vs byteps-1lane)
    max_lanes: int = 1
    codec: CodecChoice = CodecChoice.FP32  # gradient codec (auto: by link bandwidth and tensor size)
    codec_rules: tuple[str, ...] = ()  # per-tensor overrides, NAME_GLOB=CODEC, first match wins
    overlap: bool = False  # push each gradient as soon as backward produces it
    sync: Sync = Sync.SYNC  # sync (default), async, or stale (bounded staleness, bound `staleness`)
    staleness: int = 0  # stale: the fastest worker is at most this many steps ahead of the slowest
    # worker-group collectives: auto = NCCL where every member is a GPU of its own, else gloo
    collective: Collective = "auto"
    # all-reduce buckets: DDP's sizes, then larger ones tried on the running job, the fastest
    # kept (comm/buckets.py); or DDP's sizes throughout
    buckets: Buckets = "tuned"
    # gloo's socket threads: SCHED_IDLE on workers pinned to cores their compute fills (runtime/commthreads.py)
    gloo_thread: GlooThread = "auto"
    # partitions between a worker and a summation server on one host (comm/shm/channel.py)
    server_link: ServerLink = "auto"

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise UserError(_explain(err)) from None

    @property
    def op_timeout_s(self) -> float:
        """Bound on one gloo operation. Lost peers are found by liveness within
        `timeout_s` (the launcher records and stops a process that died or went silent,
        so its peers' operations fail at once); this longer bound is the backstop for
        what liveness cannot see (a whole node cut off with the store), and it lets a
        live peer be slow, e.g. in its setup before the first step on a loaded host."""
        return max(4.0 * self.timeout_s, 60.0)

    @property
    def rendezvous_timeout_s(self) -> float:
        """How long processes wait for each other to start (imports on a loaded host)."""
        return max(self.op_timeout_s, 300.0)

    @property
    def server_shm(self) -> bool:
        """A worker and a summation server on one host move partitions through shared
        memory (`--server-link auto`), not gloo over loopback (`gloo`)."""
        return self.server_link == "auto"

    @property
    def has_servers(self) -> bool:
        """Summation servers sum the gradients (every mode but all-reduce)."""
        return self.mode.has_servers

    @property
    def synchronous(self) -> bool:
        """Workers average every step's gradients before any update (`--sync sync`)."""
        return self.sync.synchronous

    @property
    def coded(self) -> bool:
        """A gradient may go on the wire in another codec than fp32 (`--codec`, `--codec-rule`)."""
        return self.codec.coded or bool(self.codec_rules)

    @property
    def tunes_buckets(self) -> bool:
        """The job's all-reduce measures larger buckets than DDP's (`--buckets tuned`)."""
        return self.buckets == "tuned"

    @property
    def bound(self) -> float:
        """Steps the fastest worker may run ahead of the slowest (sync 0, async no bound)."""
        return self.sync.bound(self.staleness)

    @field_validator("partition_bytes")
    @classmethod
    def _partition(cls, v: int) -> int:
        if v < 1024:
            raise ValueError(f"partition_bytes={v} is too small; use at least 1024 (BytePS uses 4096000)")
        return v

    @field_validator("credit_bytes")
    @classmethod
    def _credit(cls, v: int) -> int:
        if v < 0:
            raise ValueError("credit_bytes must be >= 0 (0 picks a default)")
        return v

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"--timeout {v} is not a positive finite number of seconds")
        return v

    @field_validator("max_lanes")
    @classmethod
    def _lanes(cls, v: int) -> int:
        if not 1 <= v <= 16:
            raise ValueError(f"max_lanes={v} must be between 1 and 16")
        return v

    @field_validator("codec_rules", mode="before")
    @classmethod
    def _rules(cls, v):
        if isinstance(v, str):
            v = (v,)
        v = tuple(v)
        parse_rules(v)  # raises UserError naming the rule
        return v

    @field_validator("staleness")
    @classmethod
    def _staleness(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"staleness bound must be >= 0 steps, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "CommConfig":
        if not self.synchronous and not self.has_servers:
            raise ValueError(f"--sync {self.sync} needs parameter servers that hold the parameters; "
                             "use --mode ps, byteps or colocated")
        if not self.synchronous and self.coded:
            raise ValueError(f"codecs are available in synchronous training only; drop --codec or use "
                             f"--sync {self.sync} with fp32")
        if not self.has_servers and self.coded:
            raise ValueError("gradient codecs need summation servers to decode and add what workers send; "
                             "use --mode byteps, ps or colocated, or --codec fp32 with --mode allreduce")
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> "CommConfig":
        return cls(**json.loads(text or "{}"))


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
    restart: int = 0  # which round of the job this is (0 = first start; +1 per restart or resize)

    @property
    def store_prefix(self) -> str:
        return round_prefix(self.restart)

    def to_environ(self, secret: str) -> dict[str, str]:
        env = {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            f"{PREFIX}RANK": str(self.rank), f"{PREFIX}WORLD_SIZE": str(self.world_size),
            f"{PREFIX}MASTER_ADDR": self.master_addr, f"{PREFIX}MASTER_PORT": str(self.master_port),
            f"{PREFIX}JOB_ID": self.job_id, f"{PREFIX}CLUSTER": self.cluster_json,
            f"{PREFIX}COMM": self.comm.to_json(), f"{PREFIX}RUN_DIR": self.run_dir,
            f"{PREFIX}SECRET": secret, f"{PREFIX}RESTART": str(self.restart),
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
            comm=CommConfig.from_json(e.get(f"{PREFIX}COMM", "{}")),
            run_dir=e.get(f"{PREFIX}RUN_DIR", "runs/latest"),
            local_rank=int(e.get("LOCAL_RANK", "0")), local_world_size=int(e.get("LOCAL_WORLD_SIZE", "1")),
            restart=int(e.get(f"{PREFIX}RESTART", "0")),
        )


def round_prefix(restart: int) -> str:
    """Store keys of one round of a job live under this prefix, so a restarted round's
    rendezvous, admission, heartbeats and lost-peer records never meet the last one's."""
    return f"round{restart}"
