"""Cluster description: machines, their devices, NICs and addresses.

A cluster is a list of machines. A *worker* machine has a compute device (real or
emulated by a speed factor) and runs one training process per GPU (`gpus: N`, default
one), plus a co-located summation server in the modes that use one. A *cpu* machine only runs a summation
server (BytePS's spare-CPU idea). A device names its kind (`device: {kind: v100}`), in the
vocabulary of `hetrain.cluster.hardware`; the file may describe its kinds (`kinds:`),
and `ClusterSpec.inventory()` counts them, so the planner and the scheduler can work on
the same file. Files are YAML; every mistake is reported with the field's path and what
to write instead.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..fileio import Strict, read_structured, validate_file
from .hardware import DeviceKind, HardwareError, Inventory
from .units import parse_rate, parse_size

Role = Literal["worker", "cpu"]
Emulation = Literal["none", "netns", "ratelimit", "auto"]


class ClusterSpecError(HardwareError):
    """A cluster file that cannot be used; the message says where and what to fix."""


SPEED_HINT = ("speed is the share of the device's own speed it runs at, above 0 and at most 1: 1 is full speed, "
              "0.5 half; to make one worker twice as fast as another, write `speed: 1.0` and `speed: 0.5`")


class SpeedChange(Strict):
    """From `at_step` on, the device runs at `speed` (emulated interference)."""

    at_step: int = Field(ge=0)
    speed: float = Field(gt=0, le=1, json_schema_extra={"hint": SPEED_HINT})


class DeviceSpec(Strict):
    """A worker's compute device: its kind's name (described under the file's `kinds:`, or
    a bare kind: `cpu` a CPU, anything else a GPU), emulated speed factor (1 = its real speed),
    whether it is a real CUDA GPU (`cuda: true`: tensors live on `cuda:<index + local rank>`)
    or a CPU (the default; slowed down by the speed factor when below 1), and an optional
    memory override (per GPU). `index` (with `cuda: true`): the CUDA device of the
    machine's first worker on its host, so machines that share a host can each have GPUs
    of their own (unset: 0, so such machines share cuda:0 over gloo).

    `memory` unset (the default): batch shares are capped by what the device itself
    reports free (GPU: the driver; CPU: cgroup / RLIMIT_AS / available RAM, see
    `hetrain.runtime.memory`). Set it to cap shares by a given size instead."""

    kind: str = "cpu"
    speed: float = Field(default=1.0, gt=0, le=1, json_schema_extra={"hint": SPEED_HINT})
    memory: float | None = Field(default=None, description="bytes, or a string like '4GiB'; unset: measured")
    speed_schedule: tuple[SpeedChange, ...] = ()
    cuda: bool = False
    index: int | None = Field(default=None, ge=0, le=1023)

    @field_validator("memory", mode="before")
    @classmethod
    def _mem(cls, v: object) -> float | None:
        return None if v is None else parse_size(v)

    @field_validator("speed_schedule")
    @classmethod
    def _sorted(cls, v: tuple[SpeedChange, ...]) -> tuple[SpeedChange, ...]:
        steps = [c.at_step for c in v]
        if steps != sorted(set(steps)):
            raise ValueError("speed_schedule entries need strictly increasing at_step")
        return v

    @model_validator(mode="after")
    def _index_needs_cuda(self) -> "DeviceSpec":
        if self.index is not None and not self.cuda:
            raise ValueError(f"device index {self.index} names a CUDA device, but `cuda` is false; set `cuda: true` "
                             "or remove `index`")
        return self

    @property
    def first_gpu(self) -> int:
        """The CUDA device index of the machine's first worker (0 unless `index` says)."""
        return self.index or 0

    def speed_at(self, step: int) -> float:
        speed = self.speed
        for change in self.speed_schedule:
            if step >= change.at_step:
                speed = change.speed
        return speed


class MachineSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
    role: Role
    device: DeviceSpec | None = None
    bandwidth: float = Field(default=1.25e9, description="NIC bytes/s each way, or '10gbit'")
    address: str = "127.0.0.1"
    node: int = Field(default=0, ge=0, description="which launcher (node rank) starts it")
    # worker machines: one training process per GPU, bound to cuda:<local index> when
    # device.cuda is true (emulated GPUs otherwise); None = one process
    gpus: int | None = Field(default=None, ge=1, le=64)
    # a worker's own cores: its process is pinned to `threads` cores of its host that no
    # other pinned worker gets, with torch.set_num_threads / OMP_NUM_THREADS = threads
    threads: int | None = Field(default=None, ge=1, le=4096, description="cores pinned to the worker process")

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bw(cls, v: object) -> float:
        return parse_rate(v)

    @field_validator("address")
    @classmethod
    def _addr(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"address {v!r} is not an IP address (write e.g. 10.0.0.2)") from None
        return v

    @model_validator(mode="after")
    def _device_matches_role(self) -> "MachineSpec":
        if self.role == "worker" and self.device is None:
            raise ValueError(f"worker machine {self.name!r} has no device; add e.g. `device: {{kind: gpu, speed: 1.0}}`")
        if self.role == "cpu" and self.device is not None:
            raise ValueError(f"cpu machine {self.name!r} runs only a summation server; remove its `device`")
        if self.role == "cpu" and self.gpus is not None:
            raise ValueError(f"cpu machine {self.name!r} runs only a summation server; remove its `gpus`")
        if self.role == "cpu" and self.threads is not None:
            raise ValueError(f"cpu machine {self.name!r}: `threads` pins a worker's training process; summation "
                             "servers use the cores no worker is pinned to. Remove `threads` here")
        return self

    @property
    def local_workers(self) -> int:
        """Training processes on this machine (one per GPU; 0 for a cpu machine)."""
        return 0 if self.role == "cpu" else (self.gpus or 1)


class NetworkSpec(Strict):
    """How links are emulated on one host: network namespaces with tc, an in-process
    limiter (no root needed), none, or auto (netns when root, else ratelimit)."""

    emulate: Emulation = "none"
    latency_ms: float = Field(default=0.0, ge=0)
    # netns: the queue behind each tbf shaper; auto = fq_codel where the kernel has it
    qdisc: Literal["auto", "fq_codel", "fifo"] = "auto"
    queue_ms: float = Field(default=100.0, gt=0, le=1000)  # tbf's FIFO depth, in time at the link rate
    # netns: MTU of every emulated link. 9000 (jumbo frames, usual on datacenter links)
    # cuts TCP/IP header overhead from about 5% of the link to under 1%.
    mtu: int = Field(default=1500, ge=576, le=65535)


class ClusterSpec(Strict):
    name: str = "cluster"
    # what the machines' device kinds are (class, speed, memory, price, NIC), by name;
    # optional: a kind described nowhere is a bare kind (DeviceKind.bare)
    kinds: tuple[DeviceKind, ...] = ()
    machines: tuple[MachineSpec, ...]
    network: NetworkSpec = NetworkSpec()

    @field_validator("machines")
    @classmethod
    def _check(cls, machines: tuple[MachineSpec, ...]) -> tuple[MachineSpec, ...]:
        # a field validator, so errors carry the `machines` location
        names = [m.name for m in machines]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate machine names {dup}; every machine needs its own name")
        if not any(m.role == "worker" for m in machines):
            raise ValueError("the cluster has no worker machine; add at least one machine with role: worker")
        nodes = sorted({m.node for m in machines})
        if nodes != list(range(len(nodes))):
            raise ValueError(f"node ranks must be 0..N-1 without gaps, got {nodes}")
        return machines

    @model_validator(mode="after")
    def _kinds(self) -> "ClusterSpec":
        kinds = [k.name for k in self.kinds]
        dup = sorted({n for n in kinds if kinds.count(n) > 1})
        if dup:
            raise ValueError(f"kinds {dup} are described twice; describe every kind once")
        described = {k.name: k for k in self.kinds}
        for i, m in enumerate(self.machines):
            if m.device is not None and m.device.cuda and m.device.kind in described \
                    and described[m.device.kind].device_class == "cpu":
                raise ValueError(f"machines.{i}.device: kind {m.device.kind!r} is a CPU kind (class: cpu under "
                                 "`kinds:`), but `cuda: true` binds a GPU; describe the kind as class: gpu, "
                                 "or remove `cuda: true`")
        return self

    @property
    def workers(self) -> tuple[MachineSpec, ...]:
        return tuple(m for m in self.machines if m.role == "worker")

    @property
    def cpu_machines(self) -> tuple[MachineSpec, ...]:
        return tuple(m for m in self.machines if m.role == "cpu")

    @property
    def nnodes(self) -> int:
        return max(m.node for m in self.machines) + 1

    def machine(self, name: str) -> MachineSpec:
        for m in self.machines:
            if m.name == name:
                return m
        raise KeyError(f"no machine named {name!r} in cluster {self.name!r}")

    def kind(self, name: str) -> DeviceKind:
        """The device kind `name` as this file describes it under `kinds:`, else bare."""
        return next((k for k in self.kinds if k.name == name), None) or DeviceKind.bare(name)

    def kind_of(self, machine: MachineSpec) -> DeviceKind:
        """A worker's device kind, as `kind` gives it; a CUDA device whose kind is left at
        the default (`cpu`) and not described is `gpu`, a GPU of any type. (A cpu machine
        has no device: `cpu`.)"""
        device = machine.device
        if device is not None and device.cuda and device.kind == "cpu" and "cpu" not in {k.name for k in self.kinds}:
            return DeviceKind.bare("gpu")
        return self.kind(device.kind if device else "cpu")

    def inventory(self) -> Inventory:
        """The device kinds of the worker machines, each with how many devices (a machine
        counts once per worker process: `gpus: N`, else 1), in order of first appearance.
        Summation-only (`role: cpu`) machines hold no device and are not counted."""
        counts: dict[str, int] = {}
        for m in self.workers:
            name = self.kind_of(m).name
            counts[name] = counts.get(name, 0) + m.local_workers
        return Inventory.of(counts, name=self.name, described=self.kinds)

    def to_file(self) -> dict:
        """The cluster as a cluster file's mapping (sizes in bytes, rates in bytes/s)."""
        return self.model_dump(by_alias=True, exclude_defaults=True)

    def subset(self, names) -> "ClusterSpec":
        """The cluster restricted to the named machines (cluster-file order kept), as an
        elastic job runs after machines were left out. Node ranks are renumbered
        without gaps; a launcher picks its machines by name, not by this number."""
        keep = [m for m in self.machines if m.name in set(names)]
        nodes = sorted({m.node for m in keep})
        renum = {n: i for i, n in enumerate(nodes)}
        machines = tuple(m.model_copy(update={"node": renum[m.node]}) for m in keep)
        return ClusterSpec.model_validate({"name": self.name, "kinds": [k.model_dump() for k in self.kinds],
                                           "machines": [m.model_dump() for m in machines],
                                           "network": self.network.model_dump()})

    def with_emulation(self, emulate: Emulation) -> "ClusterSpec":
        return self.model_copy(update={"network": self.network.model_copy(update={"emulate": emulate})})


def parse_cluster(data: object, source: str = "<dict>") -> ClusterSpec:
    return validate_file(ClusterSpec, data, what="cluster file", source=source, docs="docs/user-guide.md",
                         error=ClusterSpecError, expected="a mapping with a `machines:` list")


def load_cluster(path: str | Path | None) -> ClusterSpec:
    """Load a YAML cluster file; None gives the built-in default cluster."""
    if path is None:
        return default_cluster()
    return parse_cluster(read_structured(path, "cluster file", ClusterSpecError), str(path))


def default_cluster() -> ClusterSpec:
    """4 worker machines of mixed speed and 2 CPU-only machines, all on this host."""
    speeds = [1.0, 1.0, 0.5, 0.25]
    machines = [
        {"name": f"w{i}", "role": "worker", "device": {"kind": f"emu{s:g}", "speed": s},
         "bandwidth": "10gbit"}
        for i, s in enumerate(speeds)
    ] + [{"name": f"c{j}", "role": "cpu", "bandwidth": "10gbit"} for j in range(2)]
    return parse_cluster({"name": "default", "machines": machines}, "<default>")


def gpu_demo_cluster(cpu_workers: int = 3, servers: int = 2) -> ClusterSpec:
    """This host as a real heterogeneous cluster: its GPU as one worker, `cpu_workers`
    CPU workers and `servers` CPU summation machines, all on 127.0.0.1. Devices are
    real (no emulated speed); memory is measured. `hetrain demo` uses it where CUDA is
    available."""
    machines = [{"name": "gpu0", "role": "worker", "device": {"kind": "cuda", "cuda": True}, "bandwidth": "10gbit"}]
    machines += [{"name": f"cpu{i}", "role": "worker", "device": {"kind": "cpu"}, "bandwidth": "10gbit"}
                 for i in range(cpu_workers)]
    machines += [{"name": f"c{j}", "role": "cpu", "bandwidth": "10gbit"} for j in range(servers)]
    return parse_cluster({"name": "gpu-host", "machines": machines}, "<gpu demo>")
