"""DDP communication hook: DDP's gradient buckets through push_pull (BytePS's and
Horovod's answer to plain DDP scripts)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UserError
from .basics import engine

class HookState:
    """State for `ddp_comm_hook`: set `batch_size` each step for weighted averaging.

    The hook treats DDP's buckets of one iteration as consecutive pieces of one flat
    gradient (DDP gives every rank the same buckets in the same order), so DDP's bucket
    rebuild after the first iteration changes nothing hetrain's servers see."""

    def __init__(self, batch_size: int = 1):
        self.batch_size = batch_size
        self.numel: int | None = None  # gradient elements per iteration (learned in the first)
        self.flat: torch.Tensor | None = None  # the iteration's buckets, back to back
        self.pieces: list = []  # (bucket buffer, offset, future) of this iteration
        self.offset = 0


def ddp_comm_hook(state: HookState, bucket) -> torch.futures.Future:
    """DDP communication hook: `model.register_comm_hook(HookState(), hetrain.ddp_comm_hook)`
    sends DDP's gradient buckets through push_pull (any mode) instead of all-reduce.

    Each bucket is handed to the engine as soon as DDP has it (its partitions leave while
    backward goes on) and the hook returns at once with a Future on the bucket's device;
    the futures complete when the sums are back (at the iteration's last bucket). The
    first iteration learns the buckets' total size and exchanges them in one push_pull."""
    eng = engine()
    buf = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future(devices=[buf.device] if buf.device.type == "cuda" else None)
    if bucket.index() == 0:
        state.pieces, state.offset = [], 0
        if state.numel is not None:
            if state.flat is None or state.flat.device != buf.device or state.flat.dtype != buf.dtype:
                state.flat = torch.empty(state.numel, dtype=buf.dtype, device=buf.device)
            # buckets fill the flat buffer front to back: collectives follow that order
            eng.begin([("ddp.grads", state.flat)], weight=state.batch_size, overlapped=True, arrival="forward")
    n = buf.numel()
    lo = state.offset
    state.pieces.append((buf, lo, fut))
    state.offset += n
    if state.numel is not None:
        if state.offset > state.numel:
            raise UserError(f"ddp_comm_hook: DDP's buckets hold more than the {state.numel} gradient elements of "
                            "the first iteration; use one HookState per DDP model")
        state.flat[lo: lo + n].copy_(buf)
        eng.ready(0, state.flat, lo, lo + n)
    if not bucket.is_last():
        return fut
    if state.numel is None:  # first iteration: learn the size, exchange everything at once
        state.numel = state.offset
        state.flat = torch.cat([b.reshape(-1) for b, _, _ in state.pieces])
        eng.push_pull([("ddp.grads", state.flat)], weight=state.batch_size)
    elif state.offset != state.numel:
        raise UserError(f"ddp_comm_hook: DDP's buckets held {state.offset} gradient elements this iteration, "
                        f"{state.numel} in the first; use one HookState per DDP model")
    else:
        eng.finish([state.flat])
    for b, off, f in state.pieces:
        b.copy_(state.flat[off: off + b.numel()].view_as(b))
        f.set_result(b)
    return fut


# DDP inspects these annotations literally; postponed (string) annotations fail its check.
ddp_comm_hook.__annotations__.update(bucket=dist.GradBucket, state=HookState,
                                     **{"return": torch.futures.Future[torch.Tensor]})
