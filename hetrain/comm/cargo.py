"""A few numbers per worker gathered by riding the job's gradient all-reduce, rather than
by a collective of their own.

Each worker writes its row into its slot of a trailer (zeros in the others' slots)
appended to one bucket of the next step; the bucket's sum then holds every worker's row,
exactly (x + 0 + ... + 0). The balancer exchanges its step-time fits this way: as a
collective of its own (gloo's all-gather) the exchange cost a worker on one core a
thread hand-off and its socket work (with the solves it skips near the floor, the
loader's exchange in bench/hetero.py's real section went from 0.32-0.39 to 0.16-0.19 ms
a step); the trailer costs writing a few numbers.

The bucket that carries it (`carrier`) is chosen when the row is attached, from the
agreed layout, and every worker attaches at the same point of its loop (the balanced
loader's end of step), so every worker's row rides the same bucket of the same step. A
buffered bucket has spare room after it for the trailer (no copy); otherwise a small
bucket is copied with the trailer appended. A cargo whose layout is no longer the one in
use when its bucket launches does not ride (its rows are then gathered).
"""
from __future__ import annotations

import numpy as np
import torch

# elements of spare room after each buffered all-reduce bucket (comm/staging/inplace.py
# `HostInPlace`), where a trailer rides in place: 32 workers' rows of 16 numbers
CARGO_ROOM = 512
# most elements of a bucket without that room that a trailer may ride by copying it
# (twice): 256 KiB of float32, about 20 us a copy on one core
CARGO_MAX = 1 << 16


def carrier(lengths: list[int], roomy: list[bool]) -> int | None:
    """The bucket a trailer rides: the smallest one with spare room for it (no copy),
    else the smallest one if it is at most CARGO_MAX elements (copied), else none (a
    layout of one bucket of the whole model in the user's own gradient: the rows are
    then gathered by a collective of their own). The same on every worker (a function
    of the agreed layout)."""
    if not lengths:
        return None
    pool = [p for p in range(len(lengths)) if roomy[p]] or list(range(len(lengths)))
    best = min(pool, key=lambda p: (lengths[p], p))
    return best if roomy[best] or lengths[best] <= CARGO_MAX else None


class Cargo:
    """One worker's row, the bucket of which layout it is to ride, and once that bucket's
    sum is in, every worker's rows (`rows`, workers x len(row), float64). A cargo dropped
    before it rides never does."""

    def __init__(self, row, slot: int, workers: int, bucket: int, layout):
        self.row = np.asarray(row, dtype=np.float64).ravel()
        self.slot, self.workers = slot, workers
        self.bucket, self.layout = bucket, layout
        self.rows: np.ndarray | None = None
        self.dropped = False

    def drop(self) -> None:
        self.dropped = True

    def trailer(self, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(self.workers, len(self.row), dtype=dtype)
        out[self.slot] = torch.from_numpy(self.row)
        return out.view(-1)


class CargoHold:
    """A transport's cargo: the one pending (it rides its bucket's next launch) and the
    one riding (its bucket's buffer with the trailer, until the sum is in)."""

    def __init__(self):
        self.pending: Cargo | None = None
        # cargo, bucket, the bucket's view, what was sent (the view and the trailer), copied or in its room
        self.riding: tuple[Cargo, int, torch.Tensor, torch.Tensor, bool] | None = None

    def attach(self, row, slot: int, workers: int, staging) -> Cargo | None:
        """`row` to ride the `carrier` bucket of `staging`'s layout (None: no bucket can
        carry it; the caller gathers the rows itself)."""
        layout = staging.layout
        need = workers * len(np.ravel(row))
        bucket = carrier([p.length for p in layout.parts],
                         [staging.with_room(p, need) is not None for p in range(len(layout.parts))])
        if bucket is None:
            return None
        if self.pending is not None:
            self.pending.drop()
        self.pending = Cargo(row, slot, workers, bucket, layout)
        return self.pending

    def load(self, pid: int, view: torch.Tensor, staging) -> torch.Tensor:
        """What to all-reduce for bucket `pid`: its buffer, or, where the pending cargo
        rides it, the buffer with the trailer after it: in the buffer's spare room, else
        in a copy."""
        cargo = self.pending
        if (cargo is None or cargo.dropped or pid != cargo.bucket or staging.layout is not cargo.layout
                or staging.on_device or view.dtype not in (torch.float32, torch.float64)):
            return view
        self.pending = None
        trailer = cargo.trailer(view.dtype)
        sent = staging.with_room(pid, len(trailer))
        if sent is None:
            sent = torch.cat([view, trailer])
        else:
            sent[view.numel():] = trailer
        self.riding = (cargo, pid, view, sent, sent.data_ptr() != view.data_ptr())
        return sent

    def unload(self, pid: int) -> None:
        """Bucket `pid`'s sum is in: where it carried the cargo, the sum goes back into the
        bucket's buffer (from a copy) and the rows to the cargo."""
        if self.riding is None or self.riding[1] != pid:
            return
        (cargo, _pid, view, sent, copied), self.riding = self.riding, None
        if copied:
            view.copy_(sent[:view.numel()])
        if not cargo.dropped:
            cargo.rows = sent[view.numel():].view(cargo.workers, -1).to(torch.float64).numpy()
