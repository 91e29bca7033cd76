"""The run spec: everything a pipeline process needs, compiled from a plan by
`hetrain train` and written as JSON next to the run. Every process derives its role
(stage s replica r, or sparse shard j) from its rank and this spec alone."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from ..errors import UserError
from ..fileio import format_validation_error, read_text
from .data import CTRDataConfig
from .devicemap import StageDevice
from .sparse_ps import SparseOptim
from .workload import CTRModelConfig


@dataclass(frozen=True)
class StageSpec:
    start: int                  # first layer
    end: int                    # one past the last layer
    type: str                   # catalogue resource type
    kind: str                   # cpu | gpu
    instances: int
    time_per_sample_s: float    # cost model: compute + activation transfer, one instance
    allreduce_s: float          # cost model: ring all-reduce of the stage's dense params per step
    device: StageDevice = "emulated"  # what computes: pipeline/devicemap.py
    threads: int = 0            # real CPU devices: cores of its own per replica (0: unpinned, one thread)
    memory_bytes: float = 0.0   # cost model: what one replica keeps (dense state + stored activations)

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise UserError(f"stage layers {self.start}..{self.end - 1} are empty; fix the plan's `layers`")
        if self.instances < 1:
            raise UserError(f"stage on {self.type} has {self.instances} instances; the plan must give each stage >= 1")
        if self.device not in ("emulated", "cpu", "cuda"):
            raise UserError(f"stage on {self.type}: device must be emulated, cpu or cuda, got {self.device!r}")


@dataclass(frozen=True)
class Role:
    kind: str        # stage | shard
    index: int       # stage index or shard index
    replica: int = 0


@dataclass
class RunSpec:
    stages: list[StageSpec]
    batch: int = 1024                 # global samples per step
    micro_batches: int = 32           # per step, over all replicas of a stage
    steps: int = 6
    warmup_steps: int = 1             # not counted in measured throughput
    ps_shards: int = 2
    emulate: bool = True              # pad each micro-batch to the cost model's time
    optim: SparseOptim = field(default_factory=SparseOptim)
    model: CTRModelConfig = field(default_factory=CTRModelConfig)
    data: CTRDataConfig = field(default_factory=CTRDataConfig)
    ckpt_dir: str = ""
    ckpt_every: int = 0               # 0: only at the end
    resume: bool = False
    metrics_dir: str = ""
    fail_rank: int = -1               # fault injection for tests: this rank kills itself...
    fail_step: int = -1               # ...after finishing this step

    def __post_init__(self) -> None:
        if isinstance(self.optim, dict):
            self.optim = SparseOptim(**self.optim)
        if isinstance(self.model, dict):
            self.model = CTRModelConfig(**self.model)
        if isinstance(self.data, dict):
            self.data = CTRDataConfig(**self.data)
        self.stages = [s if isinstance(s, StageSpec) else StageSpec(**s) for s in self.stages]
        if not self.stages:
            raise UserError("the plan has no stages")
        if self.micro_batches < 1 or self.micro_batches > self.batch:
            raise UserError(f"micro_batches={self.micro_batches} must be between 1 and the batch size {self.batch}")
        if self.micro_batches > 512:
            raise UserError("at most 512 micro-batches per step (message tags are derived from them)")
        if self.steps < 1 or not 0 <= self.warmup_steps < self.steps:
            raise UserError(f"need steps >= 1 and 0 <= warmup_steps < steps, got {self.steps}, {self.warmup_steps}")
        if self.ps_shards < 1:
            raise UserError("ps_shards must be >= 1")
        lo = 0
        for s in self.stages:
            if s.start != lo:
                raise UserError(f"stages must cover the layers in order without gaps: expected a stage "
                                f"starting at layer {lo}, got {s.start}")
            lo = s.end
        for s in self.stages:
            if self.micro_batches < s.instances:
                raise UserError(f"{s.instances} replicas of a stage need at least as many micro-batches per step; "
                                f"raise --micro-batches to >= {s.instances}")

    # ---- roles ------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.stages[-1].end

    def stage_ranks(self, s: int) -> list[int]:
        first = sum(st.instances for st in self.stages[:s])
        return list(range(first, first + self.stages[s].instances))

    @property
    def shard_ranks(self) -> list[int]:
        n = sum(st.instances for st in self.stages)
        return list(range(n, n + self.ps_shards))

    @property
    def world_size(self) -> int:
        return sum(st.instances for st in self.stages) + self.ps_shards

    def role(self, rank: int) -> Role:
        for s in range(len(self.stages)):
            ranks = self.stage_ranks(s)
            if rank in ranks:
                return Role("stage", s, ranks.index(rank))
        if rank in self.shard_ranks:
            return Role("shard", self.shard_ranks.index(rank))
        raise UserError(f"rank {rank} has no role: the job has {self.world_size} processes")

    def mb_sizes(self) -> list[int]:
        q, r = divmod(self.batch, self.micro_batches)
        return [q + (1 if i < r else 0) for i in range(self.micro_batches)]

    # ---- files ------------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1)

    @classmethod
    def load(cls, path: str | Path) -> "RunSpec":
        path = Path(path)
        try:
            data = json.loads(read_text(path, "run spec"))
        except (json.JSONDecodeError, RecursionError) as err:
            raise UserError(f"run spec {path} is not valid JSON: {err}") from None
        return parse_run_spec(data, str(path))


def parse_run_spec(data: Any, source: str = "<run spec>") -> "RunSpec":
    """A run spec from its JSON form; every field checked, errors name it."""
    if not isinstance(data, dict):
        raise UserError(f"invalid run spec {source}: expected a JSON object")
    try:
        return _RUN_SPEC.validate_python(data)
    except ValidationError as err:
        raise UserError(format_validation_error(err, f"invalid run spec {source}:", "docs/heterps-runtime.md")) from None


def lcm_micro_batches(wanted: int, instances: list[int], batch: int) -> int:
    """Micro-batches per step: at least ``wanted``, a multiple of every stage's replica
    count where that stays within the batch, so replicas get equal shares."""
    m = 1
    for k in instances:
        m = m * k // math.gcd(m, k)
    n = math.ceil(wanted / m) * m
    return n if n <= batch else wanted


# the spec's dataclasses checked field by field (unknown keys refused, __post_init__
# checks reported with their field path); built once
for _cls in (StageSpec, RunSpec, SparseOptim, CTRModelConfig, CTRDataConfig):
    _cls.__pydantic_config__ = ConfigDict(extra="forbid", strict=False)
_RUN_SPEC = TypeAdapter(RunSpec)
