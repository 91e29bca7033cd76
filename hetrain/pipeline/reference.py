"""The single-process reference and checkpoint assembly.

`train_single` trains the same model on the same data stream in one process (torch
Adagrad/SGD with sparse embedding gradients): the pipeline must reproduce it.
`assemble` rebuilds the full model from a pipeline checkpoint (dense params of every
stage and the rows of every shard), e.g. to evaluate AUC or compare parameters.
"""
from __future__ import annotations

import torch

from ..train.checkpoint import load_checkpoint
from .data import CTRData, auc
from .sparse_ps import ShardLayout
from .spec import RunSpec


def train_single(spec: RunSpec, steps: int | None = None):
    """One process, the whole global batch per step; returns the trained model."""
    model = spec.model.build()
    model.train()
    data = CTRData(spec.data)
    opt = (torch.optim.Adagrad(model.parameters(), lr=spec.optim.lr, eps=spec.optim.eps)
           if spec.optim.kind == "adagrad" else torch.optim.SGD(model.parameters(), lr=spec.optim.lr))
    for step in range(spec.steps if steps is None else steps):
        dense, ids, label = data.samples(step * spec.batch, spec.batch)
        loss = model.loss(model(dense, ids), label)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


def assemble(spec: RunSpec, step: int):
    """The full model as the pipeline's checkpoint of ``step`` holds it."""
    from .checkpoints import ckpt_path

    model = spec.model.build()
    layout = ShardLayout([spec.model.rows] * spec.model.n_tables, spec.ps_shards)
    with torch.no_grad():
        for s, st in enumerate(spec.stages):
            ck = load_checkpoint(ckpt_path(spec, step, f"stage{s}"))
            if ck is None:
                raise FileNotFoundError(f"no checkpoint of stage {s} at step {step} in {spec.ckpt_dir}")
            for name, t in ck["params"].items():
                li, pname = name.split(".", 1)
                dict(model.layers[int(li)].named_parameters())[pname].copy_(t)
        full = torch.empty(layout.total, spec.model.dim)
        for j in range(spec.ps_shards):
            ck = load_checkpoint(ckpt_path(spec, step, f"shard{j}"))
            if ck is None:
                raise FileNotFoundError(f"no checkpoint of shard {j} at step {step} in {spec.ckpt_dir}")
            full[j:: spec.ps_shards] = ck["rows"]
        t = 0
        for layer in model.layers:
            if hasattr(layer, "table"):
                layer.table.weight.copy_(full[layout.offsets[t]: layout.offsets[t + 1]])
                t += 1
    return model


def evaluate_auc(model, spec: RunSpec, n: int = 20000) -> float:
    dense, ids, label, _ = CTRData(spec.data).test_set(n)
    model.eval()
    with torch.no_grad():
        return auc(model(dense, ids).squeeze(-1), label)
