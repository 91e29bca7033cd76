"""The overlap of a DistributedOptimizer's exchange with backward: a hook on every
trained parameter hands its gradient to the engine as soon as backward has accumulated
it (after the last of `backward_passes_per_step` passes), while backward goes on with
the layers before it. Mixed into `optimizer.DistributedOptimizer`, which arms the hooks
at `zero_grad()` and waits for what is still in flight at `step()`."""
from __future__ import annotations

import torch

from ..errors import UserError


class GradHooks:
    """Backward's hooks of a DistributedOptimizer and the gradient each one sends."""

    def _register_hooks(self) -> list:
        """One post-accumulate-grad hook per trained parameter (overlap only)."""
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        return [p.register_post_accumulate_grad_hook(lambda param, i=index[id(p)]: self._grad_ready(i, param))
                for _, p in self._named]

    def _outgoing(self, param: torch.Tensor) -> torch.Tensor:
        """The gradient as it goes out: dense, divided by gradient_predivide_factor."""
        g = param.grad
        if g.is_sparse:
            if not self.sparse_as_dense:
                raise UserError("a parameter has a sparse gradient (e.g. nn.Embedding(sparse=True)); pass "
                                "DistributedOptimizer(..., sparse_as_dense=True) to exchange it densely")
            g = param.grad = g.to_dense()
        if self._predivide != 1.0:
            g.div_(self._predivide)
        return g

    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Backward produced parameter i's gradient: start pushing it now (after the
        last of `backward_passes_per_step` backward passes). Once this optimizer's
        exchange is in flight a gradient enters the engine once (`PushPull.take`)."""
        if not self._armed:
            return
        eng = self.engine
        if self.backward_passes_per_step == 1 and self._predivide == 1.0 and not param.grad.is_sparse:
            taken = eng.take(i, param.grad, self)  # counted in (at its home, or staged) and posted
            if taken:
                self._passes[i] = 1
                return
            if taken is False:  # a second gradient this step: the count below says so
                self._passes[i] = 1
        if eng.in_flight and not eng.owned_by(self):
            # another optimizer's exchange (or a push_pull) holds the engine during this
            # backward: this optimizer exchanges at its step(), after that one completes
            self._armed = False
            return
        self._passes[i] += 1
        if self._passes[i] > self.backward_passes_per_step:
            raise UserError(f"parameter {self._named[i][0]!r} got {self._passes[i]} gradients in one step but "
                            f"backward_passes_per_step={self.backward_passes_per_step}: call step() after every "
                            f"{self.backward_passes_per_step} backward passes, or raise backward_passes_per_step")
        if self._passes[i] < self.backward_passes_per_step:
            return  # accumulate locally; the exchange happens on the last pass
        if not eng.in_flight:
            if not self._announce() or not eng.begin(self._named, weight=self._batch_size, average=self._average,
                                                     overlapped=True, total=self._total, owner=self):
                self._armed = False
                return
        if eng.take(i, self._outgoing(param), self) is False:
            raise UserError(f"parameter {self._named[i][0]!r} got a second gradient in one step: overlap pushes each "
                            "gradient as soon as backward produces it; to accumulate gradients over several "
                            "backwards pass backward_passes_per_step=N (or drop --overlap)")
