"""One unit (a top-level module) of a sharded model: its parameters as views of one flat
buffer, this worker's span of it, and the unit's gradient flow to the owners.

- `flat`: the whole unit (every stage has it while the unit runs; from stage 3 its
  storage is released between uses, `untyped_storage().resize_(0)`, and refilled from
  the owners: the parameters stay views of it, so autograd's saved tensors, which are
  views too, see the refilled values in backward, as FSDP's flat parameters do);
- `shard`: the owned span as an `nn.Parameter` the wrapped optimizer steps (stage 1-2:
  a view of `flat`; stage 3: a tensor of its own, `flat` being released);
- gradients: `reduce` flattens the unit's gradients, weights them by this worker's
  batch share and sums each owner's span onto its owner (stage 1: an all-reduce of
  the whole unit, keeping the owned span).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...errors import UserError
from . import collectives as C
from .layout import UnitLayout


class FlatUnit:
    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], weights, rank: int,
                 ranks: list[int], group, stage: int, device: torch.device | None = None,
                 exchange: str = "sum") -> None:
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) != 1:
            raise UserError(f"unit {name!r} mixes dtypes/devices {sorted(map(str, dtypes))}; shard needs one dtype "
                            "and device per top-level module (cast the model first)")
        self.name, self.module, self.params = name, module, params
        self.layout = UnitLayout.build(name, [tuple(p.shape) for p in params], weights)
        self.rank, self.ranks, self.group, self.stage = rank, ranks, group, stage
        self.by_sum = exchange == "sum" and len(ranks) > 1
        p0 = params[0]
        # `device`: where the unit lives from now on (a model built on the host, sharded onto
        # a GPU smaller than its replica: only one unit is ever whole there)
        self.flat = torch.empty(self.layout.numel, dtype=p0.dtype, device=device or p0.device)
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets):
                self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + p.numel()].view(p.shape)
                if p.grad is not None:
                    p.grad = None
        if len(ranks) > 1:  # every worker starts from the same values (rank 0's), as DDP does
            C.broadcast_from(self.flat, ranks[0], group)
        s, e = self.layout.span(rank)
        own = self.flat[s:e].clone() if stage == 3 else self.flat[s:e]
        self.shard = nn.Parameter(own, requires_grad=False)
        self.gathering: list = []   # works of a gather in flight
        self.reducing: list = []    # works of a reduce in flight
        self._grad_flat: torch.Tensor | None = None
        self.pending = 0            # parameters whose gradient this backward has not accumulated yet
        if stage == 3:
            self.release()
            if self.flat.device.type == "cuda":  # the released blocks back to the cap, not the cache
                torch.cuda.empty_cache()

    # ---- parameters -------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.flat.untyped_storage().size() > 0

    def start_gather(self) -> None:
        """Refill `flat` from the owners, asynchronously (stage 3)."""
        if self.gathered or self.gathering:
            return
        self.flat.untyped_storage().resize_(self.layout.numel * self.flat.element_size())
        s, e = self.layout.span(self.rank)
        with torch.no_grad():
            self.flat[s:e].copy_(self.shard.detach())
        self.gathering = self._gather()

    def ensure_gathered(self) -> None:
        """Whole and current: gathered (stage 3) and no exchange of it still running."""
        self.start_gather()
        C.wait(self.gathering)

    def release(self) -> None:
        """Free the unit's whole parameters (stage 3); the views keep their shapes."""
        C.wait(self.gathering)
        self.flat.untyped_storage().resize_(0)

    def broadcast_params(self) -> list:
        """After the step (stage 1-2): every owner's updated span to every worker."""
        return self._gather()

    def _gather(self) -> list:
        if self.by_sum:
            return C.gather_by_sum(self.flat, self.layout.span(self.rank), self.group)
        return C.gather_from_owners(self.flat, self.layout.spans, self.ranks, self.group)

    # ---- gradients --------------------------------------------------------------------
    def start_reduce(self, scale: float, all_reduce: bool) -> None:
        """Flatten this unit's gradients (dropping them), weight them by `scale` and start
        summing them onto the owners (or onto everyone: `all_reduce`)."""
        g = torch.zeros(self.layout.numel, dtype=self.flat.dtype, device=self.flat.device)
        for p, off in zip(self.params, self.layout.offsets):
            if p.grad is not None:
                g[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        if scale != 1.0:
            g.mul_(scale)
        self._grad_flat = g
        self.reducing = (C.all_reduce(g, self.group) if all_reduce or self.by_sum
                         else C.reduce_to_owners(g, self.layout.spans, self.ranks, self.group))

    def finish_reduce(self) -> None:
        """Wait for the reduce and keep (accumulate) the owned span as the shard's gradient."""
        if self._grad_flat is None:
            return
        C.wait(self.reducing)
        s, e = self.layout.span(self.rank)
        mine = self._grad_flat[s:e]
        if self.shard.grad is None:
            self.shard.grad = mine.clone()
        else:
            self.shard.grad.add_(mine)
        self._grad_flat = None
