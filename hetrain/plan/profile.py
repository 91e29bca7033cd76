"""Layer profiles: per-layer time, activation and parameter bytes, measured on this host.

This is hetrain's one profiler. `time_passes` is its one statistic: forward+backward
passes over a few fresh micro-batches, back to back, one device synchronisation per
timing, the median of repeated timings. `profile_model` applies it to every layer of a
`ChainModel` on the CPU (and on the GPU where CUDA is available, stored beside the CPU
times under ``devices: {"cuda: <GPU name>": [seconds per sample, ...]}``), and records
the bytes of the tensors a cut after the layer would send, the bytes autograd saves for
the layer's backward (`saved_bytes`, a worker's activation memory), the parameter bytes
(embedding tables count as sparse, at their declared size) and the layer kind. The
HeterPS runtime's profile (`pipeline.hostprofile`) applies the same `time_passes` to
the runtime's stage code. Both the HeterPS planner and the whole-job planner
(`plan.job`) read the resulting `ModelProfile`.

Times on the catalogue's resource types come from the catalogue's speed table per layer
kind, or from measured per-type times stored in the profile (``measured: {type name:
[seconds per sample, ...]}``). `with_device_as(type, device)` makes a real device's
times a catalogue type's measured times (`hetrain plan --calibrate TYPE=DEVICE`), and
`calibrated_speed(device)` gives the per-kind speed to write into a catalogue.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np
from pydantic import Field, model_validator

from ..cluster.hardware import LAYER_KINDS, Inventory, LayerKind
from ..fileio import Strict, read_structured, validate_file
from ..errors import UserError
from ..perf.pipeline import Workload
from .catalogue import cost_arrays


class ProfileError(UserError):
    """A profile file that cannot be used."""


class LayerProfile(Strict):
    name: str
    kind: LayerKind
    time_s: float = Field(gt=0, description="forward+backward seconds per sample on the host")
    act_bytes: float = Field(ge=0, description="bytes per sample sent to the next layer")
    stored_act_bytes: float = Field(ge=0, description="bytes per sample kept for backward")
    dense_param_bytes: float = Field(ge=0)
    sparse_param_bytes: float = Field(ge=0)


class ModelProfile(Strict):
    model: str
    host: str = ""
    batch: int = Field(default=1, ge=1)
    layers: tuple[LayerProfile, ...] = Field(min_length=1)
    measured: dict[str, tuple[float, ...]] = Field(default_factory=dict)
    # per-layer seconds per sample measured on real devices of this host ("cuda: <name>")
    devices: dict[str, tuple[float, ...]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _lengths(self) -> "ModelProfile":
        for field, table in (("measured", self.measured), ("devices", self.devices)):
            for name, times in table.items():
                if len(times) != len(self.layers):
                    raise ValueError(f"{field}[{name!r}] has {len(times)} times, the model has "
                                     f"{len(self.layers)} layers; give one time per layer")
                if any(not (t > 0) for t in times):
                    raise ValueError(f"{field}[{name!r}] times must be > 0 seconds per sample")
        return self

    def _device(self, device: str | None) -> str:
        if device is None:
            gpus = [d for d in self.devices if d.startswith("cuda")]
            if len(gpus) != 1:
                raise ProfileError(f"profile {self.model!r} has {len(gpus)} GPU measurements "
                                   f"({sorted(self.devices)}); name the device (TYPE=DEVICE)")
            return gpus[0]
        if device not in self.devices:
            raise ProfileError(f"profile {self.model!r} has no times measured on {device!r}; it has "
                               f"{sorted(self.devices) or 'none (profile on a host with CUDA)'}")
        return device

    def calibrated_speed(self, device: str | None = None) -> dict[str, float]:
        """Speed per layer kind of a measured device against the profiling host (total
        host time of the kind's layers / their total time on the device): what to write
        under `speed:` in a catalogue."""
        times = self.devices[self._device(device)]
        out = {}
        for kind in LAYER_KINDS:
            idx = [i for i, l in enumerate(self.layers) if l.kind == kind]
            if idx:
                out[kind] = sum(self.layers[i].time_s for i in idx) / sum(times[i] for i in idx)
        return out

    def with_device_as(self, type_name: str, device: str | None = None) -> "ModelProfile":
        """This profile with a real device's layer times used for catalogue type `type_name`."""
        times = self.devices[self._device(device)]
        return self.model_copy(update={"measured": {**self.measured, type_name: tuple(times)}})

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        return parse_profile(read_structured(path, "profile file", ProfileError), str(path))

    def workload(self, catalogue: Inventory) -> Workload:
        """Arrays for the cost model: host times scaled by each type's speed per kind,
        or that type's measured times where the profile has them. `catalogue`: an
        inventory whose kinds are described for planning (`plan.catalogue.load_catalogue`)."""
        L, R = self.n_layers, len(catalogue.kinds)
        host = np.array([l.time_s for l in self.layers])
        compute = np.empty((L, R))
        for r, t in enumerate(catalogue.kinds):
            if t.name in self.measured:
                compute[:, r] = self.measured[t.name]
            else:
                compute[:, r] = host / np.array([t.speed.for_kind(l.kind) for l in self.layers])
        unknown = sorted(set(self.measured) - set(catalogue.names))
        if unknown:
            raise ProfileError(f"profile has measured times for {unknown}, which the catalogue "
                               f"{catalogue.name!r} does not list ({list(catalogue.names)})")
        arr = cost_arrays(catalogue)
        return Workload(
            compute=compute,
            act_bytes=np.array([l.act_bytes for l in self.layers]),
            stored_act_bytes=np.array([l.stored_act_bytes for l in self.layers]),
            dense_param_bytes=np.array([l.dense_param_bytes for l in self.layers]),
            sparse_param_bytes=np.array([l.sparse_param_bytes for l in self.layers]),
            type_names=catalogue.names, type_kinds=tuple(k.device_class for k in catalogue.kinds), layer_names=tuple(l.name for l in self.layers), **arr)


def parse_profile(data: object, source: str = "<dict>") -> ModelProfile:
    return validate_file(ModelProfile, data, what="profile", source=source, docs="docs/placement.md",
                         error=ProfileError, expected="a JSON object with a `layers` list")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _param_bytes(module) -> tuple[float, float]:
    """(dense, sparse) parameter bytes; embedding weights count at their declared rows."""
    import torch.nn as nn

    dense = sparse = 0.0
    sparse_ids = set()
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            rows = getattr(module, "declared_rows", m.weight.shape[0])
            sparse += float(rows) * m.weight.shape[1] * m.weight.element_size()
            sparse_ids.add(id(m.weight))
    for p in module.parameters():
        if id(p) not in sparse_ids:
            dense += p.numel() * p.element_size()
    return dense, sparse


def time_passes(once: Callable[[int], object], device, distinct: int, runs: int, repeats: int) -> float:
    """Seconds per pass of `once(k)` (one forward+backward on fresh micro-batch k), the one
    statistic every profile in hetrain uses: a warm-up pass over each of the `distinct`
    micro-batches (kernel selection, allocator), then `repeats` timings of `runs` passes
    back to back over those micro-batches (fresh rows and activations, not one
    cache-hot batch) with one device synchronisation at the end (a pipeline runs
    passes back to back; a synchronisation per pass would charge a GPU with the launch
    latency it hides in a run); the median of the repeats (robust on a shared host)."""
    import statistics

    for k in range(distinct):
        once(k)
    _sync(device)
    per_pass = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for r in range(max(1, runs)):
            once(r % distinct)
        _sync(device)
        per_pass.append((time.perf_counter() - t0) / max(1, runs))
    return statistics.median(per_pass)


def _sync(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(model, inputs, batch: int) -> tuple[float, ...]:
    """Bytes per sample autograd keeps for backward, per layer of a ChainModel, from one
    forward of the whole chain on `inputs` (a batch of `batch` samples): every tensor the
    graph saves (`torch.autograd.graph.saved_tensors_hooks`, so convolution inputs,
    attention weights, BatchNorm's normalised input count, not only the layers'
    outputs), each tensor once, charged to the first layer that saves it (a ReLU's output
    is the next convolution's input: one tensor), leaving out parameters (saved for the
    weight gradient, yet held by the model state already). The same count on any device,
    with no CUDA memory statistics."""
    from ..runtime.memory import SavedTensorCounter

    out, x = [], tuple(inputs)
    with SavedTensorCounter(model.parameters()) as counter:
        for _name, layer, _kind in model.layer_list():
            before = counter.total
            x = layer(*x)
            x = x if isinstance(x, tuple) else (x,)
            out.append((counter.total - before) / batch)
    return tuple(out)


def layer_times(model, device="cpu", batch: int = 32, repeats: int = 5, runs: int = 4, distinct: int = 4,
                seed: int = 0, progress: bool = False, name: str = "model"):
    """Per-layer forward+backward seconds per sample of a ChainModel on `device`
    (`time_passes` on `distinct` fresh micro-batches of `batch` samples), with the
    bytes per sample of each layer's outputs (what a cut after it sends). Runs on a copy
    of the model when `device` is not the CPU. Returns (times, act_bytes, saved_bytes):
    `saved_bytes` per sample, what autograd keeps for backward (`saved_bytes`)."""
    import copy

    import torch

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    run_model = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    run_model.train()
    states = [tuple(t.to(device) for t in run_model.example_inputs(batch, generator=g)) for _ in range(distinct)]
    first = states[0]
    items = run_model.layer_list()
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc=f"profile {name} on {device}", leave=False)
    times, acts = [], []
    for _lname, layer, _kind in items:
        inputs = [tuple(t.detach().requires_grad_(t.is_floating_point()) for t in st) for st in states]
        outs: list = [None] * distinct

        def once(k: int, layer=layer, inputs=inputs, outs=outs):
            layer.zero_grad(set_to_none=True)
            out = layer(*inputs[k])
            fl = [o for o in out if o.is_floating_point() and o.requires_grad]
            if fl:
                torch.autograd.backward(fl, [torch.ones_like(o) for o in fl])
            outs[k] = out

        times.append(max(time_passes(once, device, distinct, runs, repeats) / batch, 1e-12))
        states = [tuple(o.detach() for o in out) for out in outs]
        acts.append(_nbytes(states[0]) / batch)
    kept = saved_bytes(run_model, first, batch)  # before a GPU copy of the model is freed
    if device.type == "cuda":
        del run_model
        torch.cuda.empty_cache()
    return tuple(times), tuple(acts), kept


def cuda_device_key(device=None) -> str:
    import torch

    return f"cuda: {torch.cuda.get_device_name(device)}"


def profile_model(model, name: str = "model", batch: int = 32, repeats: int = 5, seed: int = 0,
                  progress: bool = False, cuda: bool | None = None) -> ModelProfile:
    """Measure every layer of a ChainModel on this host: forward+backward seconds per
    sample on the CPU (`layer_times`: median of `repeats` timings over fresh
    micro-batches), the bytes a cut after each layer sends and each layer's parameter
    bytes; and, with the same statistic, on the GPU where CUDA is available
    (`cuda=None`; True/False forces it), stored under ``devices``."""
    import torch

    times, acts, saved = layer_times(model, "cpu", batch=batch, repeats=repeats, seed=seed, progress=progress,
                                     name=name)
    layers = []
    for (lname, layer, kind), t, act, kept in zip(model.layer_list(), times, acts, saved):
        dense, sparse = _param_bytes(layer)
        layers.append(LayerProfile(name=lname, kind=kind, time_s=max(t, 1e-9), act_bytes=act,
                                   stored_act_bytes=kept, dense_param_bytes=dense, sparse_param_bytes=sparse))
    host = " ".join(x for x in (platform.machine(), platform.processor(), f"torch{torch.__version__}",
                                f"threads={torch.get_num_threads()}") if x)
    devices = {}
    if cuda or (cuda is None and torch.cuda.is_available()):
        devices[cuda_device_key()] = layer_times(model, "cuda", batch=batch, repeats=max(repeats, 10), seed=seed)[0]
    return ModelProfile(model=name, host=host.strip(), batch=batch, layers=tuple(layers), devices=devices)


def load_or_profile(spec: str, batch: int = 32, repeats: int = 5, progress: bool = False) -> ModelProfile:
    """A zoo model name (profiled now) or a path to a saved profile JSON."""
    from ..models import ZOO, build_model

    if spec in ZOO:
        import torch

        torch.manual_seed(0)
        return profile_model(build_model(spec), spec, batch=batch, repeats=repeats, progress=progress)
    if spec.endswith(".json") or Path(spec).exists():
        return ModelProfile.load(spec)
    raise ProfileError(f"--model {spec!r} is neither a built-in model {sorted(ZOO)} nor a profile .json file")
