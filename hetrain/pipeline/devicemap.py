"""Which device runs each plan type: `hetrain train --devices`.

A plan names catalogue types (`cpu`, `gpu-v100`, ...). The runtime runs each stage
replica as one process; `--devices` says what computes in it:

* ``emulated`` (default): every type is an emulated device: CPU tensors, each
  micro-batch padded to the cost model's time for the type (docs/heterps-runtime.md).
* ``real``: every GPU type of the catalogue runs on this host's CUDA GPU (the replica's
  process binds it, `device.cuda: true`; every GPU replica of a host shares its first
  GPU), every CPU type as a CPU process with one torch thread; no padding: the measured
  throughput is the devices' own.
* a YAML file naming the real device of each type the plan uses, with the CPU threads
  (cores of its own, pinned) of a CPU type::

      types:
        h100: cuda
        cpu4t: {device: cpu, threads: 4}

Checked before any process starts (`check_host`): a type mapped to CUDA on a host
without a CUDA device is refused with what to change. Before training, each GPU
process checks that the GPU's free memory holds every stage placed on it
(`check_gpu_memory`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UserError
from ..fileio import format_validation_error, read_structured

RealDevice = Literal["cpu", "cuda"]
StageDevice = Literal["emulated", "cpu", "cuda"]


class DeviceMapError(UserError):
    """A --devices value or file that cannot be used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TypeDevice(_Strict):
    """The real device of one plan type."""

    device: RealDevice
    threads: int | None = Field(default=None, ge=1, le=4096,
                                description="CPU types: cores of its own (pinned) and torch threads per process")


class DeviceMap(_Strict):
    """Plan type name -> real device; no entries = every type emulated."""

    types: dict[str, TypeDevice] = Field(default_factory=dict)

    @field_validator("types", mode="before")
    @classmethod
    def _shorthand(cls, v: object) -> object:
        if isinstance(v, dict):  # `h100: cuda` is short for `h100: {device: cuda}`
            return {k: ({"device": x} if isinstance(x, str) else x) for k, x in v.items()}
        return v

    @property
    def emulated(self) -> bool:
        return not self.types

    def device_of(self, type_name: str) -> StageDevice:
        return "emulated" if self.emulated else self.for_type(type_name).device

    def threads_of(self, type_name: str) -> int | None:
        if self.emulated:
            return None
        t = self.for_type(type_name)
        return t.threads if t.device == "cpu" else None

    def for_type(self, type_name: str) -> TypeDevice:
        try:
            return self.types[type_name]
        except KeyError:
            raise DeviceMapError(f"--devices gives no device for plan type {type_name!r} (it maps "
                                 f"{sorted(self.types)}); add `{type_name}: cpu` or `{type_name}: cuda` under `types:`, "
                                 "or run on emulated devices (--devices emulated)") from None


def load_device_map(value: str, catalogue) -> DeviceMap:
    """`emulated`, `real` (GPU types -> CUDA, CPU types -> CPU, from the catalogue's
    kinds) or a YAML file (see the module docstring)."""
    if value == "emulated":
        return DeviceMap()
    if value == "real":
        return DeviceMap(types={t.name: TypeDevice(device="cuda" if t.device_class == "gpu" else "cpu")
                                for t in catalogue.kinds})
    if not Path(value).is_file():
        raise DeviceMapError(f"--devices {value!r}: write `emulated`, `real`, or the path of a YAML file mapping "
                             "plan types to devices (types: {NAME: cpu | cuda | {device: cpu, threads: N}})")
    data = read_structured(value, "devices file", DeviceMapError)
    if not isinstance(data, dict):
        raise DeviceMapError(f"invalid devices file {value}: expected a mapping with a `types:` mapping")
    try:
        out = DeviceMap.model_validate(data)
    except ValidationError as err:
        raise DeviceMapError(format_validation_error(err, f"invalid devices file {value}:",
                                                     "docs/heterps-runtime.md")) from None
    if out.emulated:
        raise DeviceMapError(f"devices file {value} maps no type; list the plan's types under `types:`")
    return out


def cuda_devices() -> int:
    """CUDA devices this host has (0 without CUDA or without a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_host(stages, cuda_count: int) -> None:
    """Every stage's real device exists on this host. `stages`: the run spec's."""
    for s, st in enumerate(stages):
        if st.device == "cuda" and cuda_count < 1:
            raise UserError(
                f"stage {s} (layers {st.start}..{st.end - 1}) is placed on {st.type}, which --devices maps to a CUDA "
                f"GPU, but this host has no CUDA device (torch.cuda.is_available() is false): run on emulated "
                f"devices (--devices emulated), map {st.type} to the CPU in a --devices file "
                f"(types: {{{st.type}: cpu}}), or make a plan without GPU types (hetrain plan --planner cpu)")


def check_gpu_memory(stages, free_bytes: int, device: str) -> None:
    """The stages placed on one GPU fit in its free memory (bytes): each replica needs its
    stage's `memory_bytes` (dense parameters, gradients and optimizer state, and the
    activations its micro-batches keep for backward; embedding tables live on the
    sparse-PS shards). Every GPU replica of a host shares the GPU, so all of them count."""
    need = [(s, st, st.instances * st.memory_bytes) for s, st in enumerate(stages) if st.device == "cuda"]
    total = sum(n for _, _, n in need)
    if total <= free_bytes:
        return
    big = max(need, key=lambda x: x[2])
    parts = ", ".join(f"stage {s} ({st.type} x{st.instances}): {n / 2**30:.2f} GiB" for s, st, n in need)
    raise UserError(
        f"the stages placed on GPU {device} need about {total / 2**30:.2f} GiB ({parts}) but it has "
        f"{free_bytes / 2**30:.2f} GiB free: free the GPU, lower the plan's batch size (hetrain plan --batch-size) "
        f"so stage {big[0]}'s activations shrink, or plan with this GPU's memory as the type's `memory` in the "
        "catalogue so the planner adds instances or moves layers")
