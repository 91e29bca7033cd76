"""What the workers push: an ordered manifest of named tensors, its digest, and a
clear error when workers disagree.

Every push_pull starts with one tiny all-reduce of [Σd, Σd², ...] where d is the
manifest digest: all workers agree iff n·Σd² = (Σd)². Only on disagreement (or a new
layout) are the full manifests exchanged, as UTF-8 bytes in tensors (never pickled),
so every rank can name the tensor and the ranks that differ.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UserError

DIGEST_BITS = 26  # d² · n stays exact in int64 for n < 2**11


class TensorMismatchError(UserError):
    """Workers pushed different tensor names or shapes in the same step."""


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> "Manifest":
        return cls(tuple(Entry(n, tuple(t.shape)) for n, t in named))

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    def encode(self) -> bytes:
        return ";".join(f"{e.name}:{'x'.join(map(str, e.shape))}" for e in self.entries).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        if not raw:
            return cls(())
        entries = []
        for item in raw.decode().split(";"):
            name, _, shape = item.rpartition(":")
            entries.append(Entry(name, tuple(int(s) for s in shape.split("x") if s)))
        return cls(tuple(entries))

    def digest(self) -> int:
        h = hashlib.blake2b(self.encode(), digest_size=8).digest()
        return 1 + int.from_bytes(h, "little") % ((1 << DIGEST_BITS) - 1)


def exchange_manifests(mine: Manifest | None, group=None) -> list[Manifest | None]:
    """All-gather every rank's manifest (None for servers) as bytes."""
    raw = mine.encode() if mine is not None else b""
    world = dist.get_world_size(group)
    length = torch.tensor([len(raw) + (1 if mine is not None else 0)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    width = max(int(x.item()) for x in lengths) or 1
    buf = torch.zeros(width, dtype=torch.uint8)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    out: list[Manifest | None] = []
    for n, b in zip(lengths, bufs):
        n = int(n.item())
        out.append(None if n == 0 else Manifest.decode(bytes(b[: n - 1].tolist())))
    return out


def describe_mismatch(manifests: dict[int, Manifest], scope: str = "") -> str:
    """Name the first tensor on which workers disagree, and who holds which version
    (`manifests` by job rank; `scope` names the group of workers, when not the job's)."""
    who = f"the workers of {scope}" if scope else "workers"
    ranks = sorted(manifests)
    names_by_rank = {r: {e.name: e for e in manifests[r].entries} for r in ranks}
    all_names: list[str] = []
    for r in ranks:
        for e in manifests[r].entries:
            if e.name not in all_names:
                all_names.append(e.name)
    for name in all_names:
        versions: dict[str, list[int]] = {}
        for r in ranks:
            e = names_by_rank[r].get(name)
            key = "missing" if e is None else f"shape {tuple(e.shape)}"
            versions.setdefault(key, []).append(r)
        if len(versions) > 1:
            parts = "; ".join(f"{v} on rank(s) {rs}" for v, rs in versions.items())
            return (f"{who} pushed different tensors in the same step: tensor {name!r} has {parts}. "
                    "Every worker must push_pull the same named tensors with the same shapes, in the same order.")
    orders = {r: [e.name for e in manifests[r].entries] for r in ranks}
    return f"{who} pushed the same tensors in different orders: {orders}. Push them in one fixed order."


def wide_floats(named) -> bool:
    """Every tensor is float32 or float64: wide enough to hold a weighted sum before it is
    divided (a speculated push_pull, comm/engine.py). Dtypes are in a layout's digest, so
    workers of one agreed layout answer alike."""
    return all(t.dtype in (torch.float32, torch.float64) for _, t in named)


def check_tensors(named, worker_device: torch.device | None, what: str = "push_pull",
                  model: bool = False) -> torch.device:
    """Every tensor a floating-point torch.Tensor, all on one device, and that device one
    this worker can use; returns it. Raises before anything is sent.

    A GPU worker (bound to cuda:i) may push host tensors or tensors on cuda:i, and its
    model (`model=True`: the optimizer's parameters) must be on cuda:i. An emulated worker
    (cpu) takes CPU tensors, and CUDA tensors of a script that binds its GPU itself (as
    torchrun scripts do from LOCAL_RANK): both are staged."""
    device = None
    first = None
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise UserError(f"{what} tensor {name!r} must be a floating-point torch.Tensor, got {type(t).__name__}"
                            f"{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise UserError(f"{what} tensors must all be on one device: {first!r} is on {device} but {name!r} is on "
                            f"{t.device}; move them together (e.g. model.to(hetrain.device()))")
        if t.device.type not in ("cpu", "cuda"):
            raise UserError(f"{what} tensor {name!r} is on {t.device}, which holds no data to send; hetrain moves "
                            "CPU and CUDA tensors (materialise the model, e.g. model.to_empty(device=...) and load "
                            "its weights, before training)")
    device = device or torch.device("cpu")
    if worker_device is not None and worker_device.type == "cuda" and device != worker_device:
        if device.type == "cuda" or model:
            raise UserError(f"{what} tensor {first!r} is on {device} but this worker is bound to {worker_device}; "
                            "put the model on hetrain.device()")
    return device
