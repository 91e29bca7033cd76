"""Layer profiles: per-layer time, activation and parameter bytes, measured on this host.

`profile_model` walks a `ChainModel`'s layers, times forward+backward of each layer on a
real batch (median of a few repeats after a warm-up), and records the bytes of the
tensors a cut after the layer would send, the parameter bytes (embedding tables count as
sparse, at their declared size) and the layer kind. Times on the catalogue's resource
types come from the catalogue's speed table per layer kind, or from measured per-type
times stored in the profile (``measured: {type name: [seconds per sample, ...]}``).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..fileio import format_validation_error, read_structured
from ..errors import UserError
from ..perf.pipeline import Workload
from .catalogue import Catalogue

Kind = Literal["dense", "memory", "sparse"]


class ProfileError(UserError):
    """A profile file that cannot be used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerProfile(_Strict):
    name: str
    kind: Kind
    time_s: float = Field(gt=0, description="forward+backward seconds per sample on the host")
    act_bytes: float = Field(ge=0, description="bytes per sample sent to the next layer")
    stored_act_bytes: float = Field(ge=0, description="bytes per sample kept for backward")
    dense_param_bytes: float = Field(ge=0)
    sparse_param_bytes: float = Field(ge=0)


class ModelProfile(_Strict):
    model: str
    host: str = ""
    batch: int = Field(default=1, ge=1)
    layers: tuple[LayerProfile, ...] = Field(min_length=1)
    measured: dict[str, tuple[float, ...]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _lengths(self) -> "ModelProfile":
        for name, times in self.measured.items():
            if len(times) != len(self.layers):
                raise ValueError(f"measured[{name!r}] has {len(times)} times, the model has "
                                 f"{len(self.layers)} layers; give one time per layer")
            if any(not (t > 0) for t in times):
                raise ValueError(f"measured[{name!r}] times must be > 0 seconds per sample")
        return self

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        return parse_profile(read_structured(path, "profile file", ProfileError), str(path))

    def workload(self, catalogue: Catalogue) -> Workload:
        """Arrays for the cost model: host times scaled by each type's speed per kind,
        or that type's measured times where the profile has them."""
        L, R = self.n_layers, len(catalogue.types)
        host = np.array([l.time_s for l in self.layers])
        compute = np.empty((L, R))
        for r, t in enumerate(catalogue.types):
            if t.name in self.measured:
                compute[:, r] = self.measured[t.name]
            else:
                compute[:, r] = host / np.array([t.speed.for_kind(l.kind) for l in self.layers])
        unknown = sorted(set(self.measured) - set(catalogue.names))
        if unknown:
            raise ProfileError(f"profile has measured times for {unknown}, which the catalogue "
                               f"{catalogue.name!r} does not list ({list(catalogue.names)})")
        arr = catalogue.arrays()
        return Workload(
            compute=compute,
            act_bytes=np.array([l.act_bytes for l in self.layers]),
            stored_act_bytes=np.array([l.stored_act_bytes for l in self.layers]),
            dense_param_bytes=np.array([l.dense_param_bytes for l in self.layers]),
            sparse_param_bytes=np.array([l.sparse_param_bytes for l in self.layers]),
            type_names=catalogue.names, type_kinds=tuple(t.kind for t in catalogue.types), layer_names=tuple(l.name for l in self.layers), **arr)


def parse_profile(data: object, source: str = "<dict>") -> ModelProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"invalid profile {source}: expected a JSON object with a `layers` list")
    try:
        return ModelProfile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(format_validation_error(err, f"invalid profile {source}:", "docs/placement.md")) from None


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


def profile_model(model, name: str = "model", batch: int = 32, repeats: int = 5, seed: int = 0,
                  progress: bool = False) -> ModelProfile:
    """Measure every layer of a ChainModel on this host (CPU): fwd+bwd time per sample
    (the minimum over ``repeats`` timed runs after one warm-up run of the layer)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model.train()
    state = model.example_inputs(batch, generator=g)
    out = model(*state)  # warm-up: first calls allocate and pick kernels
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    layers = []
    items = model.layer_list()
    it = items
    if progress:
        from tqdm import tqdm
        it = tqdm(items, desc=f"profile {name}", leave=False)
    for lname, layer, kind in it:
        inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in state)
        times = []
        for rep in range(repeats + 1):
            layer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            out = layer(*inputs)
            fl = [o for o in out if o.is_floating_point() and o.requires_grad]
            if fl:
                torch.autograd.backward(fl, [torch.ones_like(o) for o in fl])
            times.append(time.perf_counter() - t0)
        t = float(np.min(times[1:])) / batch  # min: the host is shared, noise only adds time
        outs = tuple(o.detach() for o in out)
        act = _nbytes(outs) / batch
        dense, sparse = _param_bytes(layer)
        layers.append(LayerProfile(name=lname, kind=kind, time_s=max(t, 1e-9), act_bytes=act,
                                   stored_act_bytes=act, dense_param_bytes=dense,
                                   sparse_param_bytes=sparse))
        state = outs
    host = f"{platform.machine()} {platform.processor() or ''} torch{torch.__version__} threads={torch.get_num_threads()}"
    return ModelProfile(model=name, host=host.strip(), batch=batch, layers=tuple(layers))


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
