"""The vocabulary of a job's gradient exchange: communication mode, training sync and
gradient codec, each an enum whose members are the strings users write (`--mode byteps`,
YAML `sync: stale`, a plan's `codec: int8`) and that results files carry.

Why one module of enums: the job picks each of these once, when its configuration is
parsed (runtime/env.py `CommConfig`, the cost model's `Candidate`, the planner's files);
every other place asks the parsed value a question (`Mode.has_servers`,
`Sync.synchronous`, `Codec.lossy`) instead of comparing names, so adding a mode or a
codec means answering those questions here, not finding every comparison. The members
are `StrEnum`s, so JSON, YAML, f-strings and argparse see the plain words.

Why here, beside errors.py and below every part: the cost model (perf, numpy-only, which
may import no runtime, comm, plan or sched) prices modes and codecs, the runtime
validates them, the engine and the API act on them; only a module under all of them
can serve each. It imports nothing of hetrain but `errors`.
"""
from __future__ import annotations

import math
from enum import StrEnum

from .errors import UserError


def _choose(what: str, value: object, options) -> UserError:
    words = [str(o) for o in options]
    listed = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
    return UserError(f"unknown {what} {value!r}; choose {listed}")


class Mode(StrEnum):
    """How gradients are summed: by summation servers (where they run is the mode) or by
    an all-reduce among the workers (docs/architecture.md has the table)."""

    BYTEPS = "byteps"  # servers on the worker machines and on the CPU machines (the BytePS optimum)
    PS = "ps"  # servers on the CPU machines only
    COLOCATED = "colocated"  # a server on each worker machine
    ALLREDUCE = "allreduce"  # no servers: torch.distributed all-reduce among the workers

    @classmethod
    def parse(cls, value: "str | Mode", allowed: "tuple[Mode, ...] | None" = None) -> "Mode":
        """The member named `value` (a UserError naming the choices otherwise)."""
        options = tuple(cls) if allowed is None else allowed
        try:
            mode = cls(value)
        except ValueError:
            raise _choose("communication mode", value, options) from None
        if mode not in options:
            listed = ", ".join(str(o) for o in options[:-1]) + " or " + str(options[-1])
            raise UserError(f"communication mode '{mode}' does not apply here; choose {listed}")
        return mode

    @property
    def has_servers(self) -> bool:
        """Summation servers sum the gradients (every mode but all-reduce)."""
        return self is not Mode.ALLREDUCE

    @property
    def worker_servers(self) -> bool:
        """A summation server runs on worker machines."""
        return self in (Mode.BYTEPS, Mode.COLOCATED)

    @property
    def cpu_servers(self) -> bool:
        """A summation server runs on the CPU machines."""
        return self in (Mode.BYTEPS, Mode.PS)

    @property
    def priced(self) -> "Mode":
        """The mode the cost model prices this one as: co-located servers are BytePS
        without CPU machines (perf/job.py prices all-reduce, BytePS and PS)."""
        return Mode.BYTEPS if self is Mode.COLOCATED else self


# the modes the whole-job cost model prices (perf/job.py)
PRICED_MODES: tuple[Mode, ...] = (Mode.ALLREDUCE, Mode.BYTEPS, Mode.PS)


class Sync(StrEnum):
    """How workers and parameters advance: in lockstep, or against parameter-holding
    servers without waiting (async) or at most `staleness` steps apart (stale)."""

    SYNC = "sync"
    ASYNC = "async"
    STALE = "stale"

    @classmethod
    def parse(cls, value: "str | Sync") -> "Sync":
        try:
            return cls(value)
        except ValueError:
            raise _choose("training mode", value, tuple(cls)) from None

    @property
    def synchronous(self) -> bool:
        """Every step's gradients are averaged over the workers before any update."""
        return self is Sync.SYNC

    def bound(self, staleness: int) -> float:
        """How many steps the fastest worker may run ahead of the slowest (async: no bound)."""
        return math.inf if self is Sync.ASYNC else float(staleness) if self is Sync.STALE else 0.0


class Codec(StrEnum):
    """A gradient codec: the bits each element takes on the wire."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def parse(cls, value: "str | Codec") -> "Codec":
        try:
            return cls(value)
        except ValueError:
            raise _choose("codec", value, tuple(cls)) from None

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def ratio(self) -> float:
        """Wire bytes per fp32 byte (scales aside)."""
        return _BITS[self] / 32

    @property
    def lossy(self) -> bool:
        """Not exact: sent with error feedback, with an fp32 residual kept per element."""
        return self is not Codec.FP32


_BITS = {Codec.FP32: 32, Codec.FP16: 16, Codec.INT8: 8, Codec.INT4: 4}


class CodecChoice(StrEnum):
    """What a user may ask for: a codec, or `auto` (one per tensor, by link bandwidth and
    tensor size: comm/compress.py `auto_codec`)."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: "str | CodecChoice") -> "CodecChoice":
        try:
            return cls(value)
        except ValueError:
            raise _choose("codec", value, tuple(cls)) from None

    @property
    def codec(self) -> Codec | None:
        """The codec asked for; None for `auto` (decided per tensor)."""
        return None if self is CodecChoice.AUTO else Codec(self.value)

    @property
    def coded(self) -> bool:
        """Anything but plain fp32 may go on the wire."""
        return self is not CodecChoice.FP32
