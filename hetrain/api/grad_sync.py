"""A DistributedOptimizer's gradient exchange at step time (Horovod's `synchronize`,
`skip_synchronize`): the announcement to workers that called `hetrain.join()`, the
exchange itself (completing what the backward hooks began, `grad_hooks.py`), a joined
worker's shadow part in it, and Adasum's exchange of parameter updates. Mixed into
`optimizer.DistributedOptimizer`, whose `step()` calls `synchronize()` unless it ran."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..errors import UserError
from . import uneven as _join
from .adasum import adasum_allreduce
from .ops import _drain
from .reduce_op import ReduceOp


class GradientSync:
    """Exchanging a DistributedOptimizer's gradients among the step's workers."""

    def _announce(self) -> bool:
        """Before each exchange, one tiny all-reduce tells workers that have joined
        (hetrain.join, api/uneven.py) that this optimizer exchanges now, so they take part
        with zero gradients and batch weight 0. True when no worker has joined; otherwise
        the exchange runs unoverlapped at step(), as the joined workers' does."""
        if self._announced:
            return False
        if self._total is not None:
            # the step's total came with its batch (BalancedLoader): every worker takes this
            # step by the loader's contract (its own per-step exchange admits no joined
            # worker), so there is nobody to announce to; the step stays free of any
            # collective besides its buckets, as DDP's is
            return True
        t0 = time.perf_counter()
        active = _join.announce(_join.Kind.OPTIMIZER, self._join_index)
        stats = getattr(self.engine, "stats", None)
        if stats is not None:  # waiting for the other workers, never this worker's compute (the balancer reads it)
            stats.wait_s += time.perf_counter() - t0
        if active == self.engine.ctx.num_workers:
            return True
        self._announced = True
        self._armed = False
        return False

    def synchronize(self) -> None:
        """Exchange the gradients now (Horovod's `synchronize`), e.g. to clip them before
        `with opt.skip_synchronize(): opt.step()`. step() does it unless it already happened
        this step."""
        if not self.sync.synchronous:
            raise UserError(f"synchronize() exchanges gradients synchronously but this job runs sync='{self.sync}', "
                            "where step() pushes them to the parameter servers")
        if self.op == ReduceOp.ADASUM:
            raise UserError("synchronize() with op=hetrain.Adasum: the Adasum optimizer combines the workers' "
                            "parameter updates after each local step, so there is no exchanged gradient to look at; "
                            "use op=hetrain.Average to clip exchanged gradients")
        if self._out:  # sitting this step out (set_exchange): nothing to add, nothing to take
            self._armed, self._synced, self._size_set, self._total = False, True, False, None
            self._passes = [0] * len(self._named)
            return
        _drain()
        self.engine.complete_other(self)  # another optimizer's exchange still in flight: it completes first
        if not self.engine.in_flight and not self._announced:
            self._announce()
        for _, p in self._named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._armed = False
        if self.engine.owned_by(self):  # overlap: most partitions are already on their way
            handed = self.engine.handed_over()
            named = [(n, p.grad if handed[i] else self._outgoing(p)) for i, (n, p) in enumerate(self._named)]
            self.engine.finish([t for _, t in named])
        else:
            named = [(n, self._outgoing(p)) for n, p in self._named]
            # a joined worker's shadow exchange (below) runs the step header, so the others
            # must too: the loader's total only spares it when every worker is training
            total = None if self._announced else self._total
            self.engine.push_pull(named, weight=self._batch_size, average=self._average, total=total)
        if self._predivide != 1.0:
            for _, t in named:
                t.mul_(self._predivide)
        self._passes = [0] * len(self._named)
        self._synced = True
        self._announced = False
        self._size_set = False
        self._total = None  # known for one step only

    def complete_exchange(self) -> None:
        """Complete this optimizer's exchange in flight now (the engine asks, when another
        exchange needs it first): as `synchronize`, so step() will not exchange again.
        Only once backward has handed it gradients: an exchange begun before backward
        (the batch size known at zero_grad) would send gradients not yet computed."""
        if not any(self._passes):
            raise UserError("another exchange (push_pull, or a second DistributedOptimizer's step) was asked for "
                            "between this DistributedOptimizer's zero_grad() and backward(), while its own exchange "
                            "had begun: make that call after optimizer.step() (or before zero_grad())")
        self.synchronize()

    def _shadow_exchange(self) -> None:
        """A joined worker's part in the others' exchange (api/uneven.py): zero gradients
        with batch weight 0, so the average is over the workers still training."""
        if self.op == ReduceOp.ADASUM:
            for _, p in self._named:
                adasum_allreduce(torch.zeros_like(p), "DistributedOptimizer (joined worker)")
            return
        named = [(n, torch.zeros_like(p)) for n, p in self._named]
        self.engine.push_pull(named, weight=0, average=self._average)

    @contextmanager
    def skip_synchronize(self):
        """`step()` inside this block runs the optimizer without exchanging gradients
        (call synchronize() first), e.g. to clip the averaged gradients in between."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def _adasum_step(self, closure):
        """Horovod's Adasum optimizer: step on this worker's own gradients, then replace
        each parameter's update by the Adasum of all workers' updates."""
        if not self._announced:
            self._announce()
        start = [p.detach().clone() for _, p in self._named]
        loss = self._inner.step(closure)
        with torch.no_grad():
            for (n, p), s in zip(self._named, start):
                p.copy_(s + adasum_allreduce(p.detach() - s, f"DistributedOptimizer Adasum of {n!r}"))
        self._passes = [0] * len(self._named)
        self._announced = False
        return loss
