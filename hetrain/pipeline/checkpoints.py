"""Where a pipeline job's checkpoints go: one file per stage and per sparse-PS shard and
step, the newest step every one of them saved, and when to save."""
from __future__ import annotations

from pathlib import Path

from ..train.checkpoint import save_checkpoint
from .spec import RunSpec


def ckpt_path(spec: RunSpec, step: int, name: str) -> Path:
    return Path(spec.ckpt_dir) / f"step-{step:07d}" / f"{name}.pt"


def latest_complete(spec: RunSpec) -> int:
    """Newest checkpointed step for which every stage and every shard saved its file."""
    root = Path(spec.ckpt_dir)
    if not spec.ckpt_dir or not root.is_dir():
        return 0
    names = [f"stage{s}" for s in range(len(spec.stages))] + [f"shard{j}" for j in range(spec.ps_shards)]
    steps = sorted((int(p.name.split("-")[1]) for p in root.glob("step-*") if p.name.split("-")[1].isdigit()),
                   reverse=True)
    for s in steps:
        if all(ckpt_path(spec, s, n).is_file() for n in names):
            return s
    return 0


def save(spec: RunSpec, step: int, name: str, state: dict) -> None:
    save_checkpoint(ckpt_path(spec, step, name), {"step": step, **state})
    # keep this file's two newest generations: a crash while others save leaves a complete older one
    mine = sorted(int(p.parent.name.split("-")[1]) for p in Path(spec.ckpt_dir).glob(f"step-*/{name}.pt"))
    for old in mine[:-2]:
        ckpt_path(spec, old, name).unlink(missing_ok=True)


def want_ckpt(spec: RunSpec, done: int) -> bool:
    return bool(spec.ckpt_dir) and (done == spec.steps or (spec.ckpt_every > 0 and done % spec.ckpt_every == 0))
