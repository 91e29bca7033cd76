"""The scaled-down CTR workload the runtime trains, and its emulated layer profile.

`CTRModelConfig` builds a DLRM-like `hetrain.models.ctr.CTRModel` (8 features x 20,000
rows x 16 dims by default: small enough for a 2-core host). Its profile for the planner
(`emulated_profile`) takes the layer names, kinds, activation and parameter bytes from
the real model, and per-sample *emulated* compute times on the reference CPU type,
modelled on a full-size DLRM's proportions (lookups into huge tables are IO-bound and
slow, the top MLP dominates dense compute). The runtime makes every micro-batch take
exactly what the cost model says for these times (see docs/heterps-runtime.md), so the
prediction and the measurement describe the same emulated cluster.

Run ``python -m hetrain.pipeline.workload profile.json`` to write the profile for
``hetrain plan --model profile.json``. Beside the emulated times it stores the real
model's per-layer times measured on this host's devices (`measured_devices`: the CPU,
and the GPU where CUDA is available, with CUDA events), so a catalogue's GPU types can
be calibrated from a real GPU (``hetrain plan --calibrate TYPE=DEVICE``); the emulated
runtime keeps using the emulated times. ``--no-measure`` skips the measurement.
"""
from __future__ import annotations

import sys
from importlib import resources
from dataclasses import asdict, dataclass

import torch

from ..errors import UserError
from ..plan.profile import LayerProfile, ModelProfile

MODEL_NAME = "ctr-small"
# the emulated cluster's catalogue (shipped as package data next to the other catalogues)
CATALOGUE = str(resources.files("hetrain.data").joinpath("catalogue_heterps_emu.yaml"))

# seconds per sample on the reference CPU type (speed 1 in the emulated catalogue)
EMULATED_TIME_S = {"bottom": 0.15e-3, "emb": 0.10e-3, "interact": 0.20e-3, "top": 0.80e-3}


@dataclass(frozen=True)
class CTRModelConfig:
    n_tables: int = 8
    rows: int = 20000
    dim: int = 16
    n_dense: int = 13
    bottom: tuple[int, ...] = (64,)
    top: tuple[int, ...] = (64, 32)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_tables < 1 or self.rows < 1 or self.dim < 1:
            raise UserError(f"CTR model needs n_tables, rows, dim >= 1, got {self}")
        object.__setattr__(self, "bottom", tuple(self.bottom))
        object.__setattr__(self, "top", tuple(self.top))

    def build(self):
        """The model, with weights that depend only on ``seed`` (every process agrees)."""
        from ..models.ctr import CTRModel

        torch.manual_seed(self.seed)
        return CTRModel(table_rows=(self.rows,) * self.n_tables, dim=self.dim, n_dense=self.n_dense,
                        bottom=self.bottom, top=self.top, bag=1, rows_cap=self.rows, sparse_grad=True)

    def to_dict(self) -> dict:
        return asdict(self)


def _nbytes(ts) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def emulated_profile(cfg: CTRModelConfig = CTRModelConfig(), times: dict | None = None) -> ModelProfile:
    """Layer profile: real bytes from the model, emulated per-sample times."""
    times = {**EMULATED_TIME_S, **(times or {})}
    model = cfg.build()
    n = 8
    state = (torch.randn(n, cfg.n_dense), torch.randint(0, cfg.rows, (n, cfg.n_tables, 1)))
    layers = []
    with torch.no_grad():
        for name, layer, kind in model.layer_list():
            state = layer(*state)
            act = _nbytes(state) / n
            dense = sparse = 0.0
            for pn, p in layer.named_parameters():
                if kind == "sparse":
                    sparse += p.numel() * p.element_size()
                else:
                    dense += p.numel() * p.element_size()
            key = next(k for k in times if name.startswith(k))
            layers.append(LayerProfile(name=name, kind=kind, time_s=times[key], act_bytes=act,
                                       stored_act_bytes=act, dense_param_bytes=dense, sparse_param_bytes=sparse))
    return ModelProfile(model=MODEL_NAME, host="emulated reference CPU (hetrain.pipeline.workload)",
                        batch=1, layers=tuple(layers))


def measured_devices(cfg: CTRModelConfig = CTRModelConfig(), batch: int = 64) -> dict[str, tuple[float, ...]]:
    """The real model's per-layer seconds per sample on this host: ``cpu: <host>``
    (`profile_model`'s CPU timing) and ``cuda: <GPU name>`` where CUDA is available."""
    from ..plan.profile import profile_model

    prof = profile_model(cfg.build(), MODEL_NAME, batch=batch)
    return {f"cpu: {prof.host}": tuple(l.time_s for l in prof.layers), **prof.devices}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = args[0] if args else "ctr-small-profile.json"
    prof = emulated_profile()
    if "--no-measure" not in sys.argv:
        prof = prof.model_copy(update={"devices": measured_devices()})
        for dev in prof.devices:
            print(f"measured on {dev}")
    prof.save(out)
    print(f"wrote {out}")
