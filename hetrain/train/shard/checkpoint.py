"""Sharded checkpoints that load on another number or mix of workers (resharded).

`save(opt, dir)`: every worker writes its spans (parameters and optimizer state) to
`dir/shard-<rank>.pt`; worker 0 writes `dir/meta.pt` (each unit's size and the owners'
spans). Each file is written atomically (train/checkpoint.py), and no worker ever holds
more than its own spans, so a model too large for one worker saves and loads.

`load(opt, dir)`: each worker reads, unit by unit, the parts of the saved spans that
overlap its own span under the new layout (any number of workers, any weights): the
files are opened memory-mapped, so only those parts are read. The directory must be
visible to every worker (one host, or a shared file system).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ...errors import UserError
from ..checkpoint import CheckpointError, save_checkpoint
from . import collectives as C


def _barrier(opt) -> None:
    if opt.size > 1:
        dist.barrier(group=opt.group)


def save(opt, directory: str | Path) -> None:
    """Write this worker's spans; a collective (every worker calls it)."""
    d = Path(directory)
    for u in opt.units:  # the last step's exchange done (it writes the flat buffers the spans live in)
        C.wait(u.gathering)
    units = []
    for u in opt.units:
        st = opt.optimizer.state.get(u.shard, {})
        s, e = u.layout.span(u.rank)
        units.append({"start": s, "end": e, "param": u.shard.detach().clone(),
                      "state": {k: (v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
                                for k, v in st.items()}})
    save_checkpoint(d / f"shard-{opt.rank}.pt", {"rank": opt.rank, "units": units})
    if opt.rank == 0:
        save_checkpoint(d / "meta.pt", {"size": opt.size, "stage": opt.stage,
                                        "numels": [u.layout.numel for u in opt.units],
                                        "spans": [[list(sp) for sp in u.layout.spans] for u in opt.units]})
    _barrier(opt)


def _open(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001  (torch raises several kinds for a damaged file)
        raise CheckpointError(f"sharded checkpoint file {path} cannot be read ({e}); save it again") from e


def load(opt, directory: str | Path) -> None:
    """Load a checkpoint saved by `save` on any number of workers; a collective."""
    d = Path(directory)
    if not (d / "meta.pt").is_file():
        raise UserError(f"{d} holds no sharded checkpoint (no meta.pt); give the directory `save` wrote")
    meta = _open(d / "meta.pt")
    numels = [u.layout.numel for u in opt.units]
    if list(meta["numels"]) != numels:
        raise UserError(f"the checkpoint in {d} is of a model with units of {list(meta['numels'])} elements, "
                        f"this one has {numels}; load it into the same model")
    files: dict[int, dict] = {}
    for k, u in enumerate(opt.units):
        state: dict[str, torch.Tensor] = {}
        for r, old in enumerate(meta["spans"][k]):
            part = u.layout.overlap(u.rank, tuple(old))
            if part is None:
                continue
            if r not in files:
                files[r] = _open(d / f"shard-{r}.pt")
            saved = files[r]["units"][k]
            lo, hi = part[0] - saved["start"], part[1] - saved["start"]
            mine = slice(part[0] - u.layout.span(u.rank)[0], part[1] - u.layout.span(u.rank)[0])
            with torch.no_grad():
                u.shard[mine].copy_(saved["param"][lo:hi])
            for key, v in saved["state"].items():
                if v.dim() == 1 and v.numel() == saved["end"] - saved["start"]:
                    if key not in state:
                        state[key] = torch.zeros_like(u.shard.detach())
                    state[key][mine].copy_(v[lo:hi])
                else:  # a scalar (Adam's step): the same on every worker
                    state[key] = v.clone()
        if not state:  # this worker owns nothing of the unit: the scalars from any saved span
            saved = _open(d / "shard-0.pt")["units"][k]["state"]
            state = {key: (torch.zeros_like(u.shard.detach()) if v.dim() == 1 else v.clone())
                     for key, v in saved.items()}
        if state:
            opt.optimizer.state[u.shard] = state
    if opt.stage < 3:  # the whole parameters from their new owners
        for u in opt.units:
            C.wait(u.gathering)
            u.gathering = u.broadcast_params()
            C.wait(u.gathering)
    _barrier(opt)
