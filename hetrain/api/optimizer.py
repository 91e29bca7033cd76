"""DistributedOptimizer: the wrapped optimizer whose step() first averages gradients
over the workers (Horovod's `optimizer`)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..comm.engine import check_tensors
from ..errors import UserError
from .basics import engine
from .compression import _codec_name
from .ops import _drain

class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer: `step()` first averages gradients over workers, weighted by
    each worker's batch size (`set_batch_size`, default 1 = equal weights).

    With `overlap=True` (default: the job's `--overlap`; always in mode allreduce, as in
    PyTorch DDP, whose bucketed all-reduce runs during backward), each parameter's gradient is
    pushed as soon as backward has accumulated it, while backward goes on with the
    layers before it; `step()` then only waits for what is still in flight. Call
    `zero_grad()` once per step (it arms the hooks), then `set_batch_size` before
    `backward()` (it exchanges the step header, so the hooks only send).

    On a GPU worker (model on `hetrain.device()`) the hooks only record an event and
    queue a copy to pinned host memory (no host sync inside backward); `step()` makes the
    compute stream wait for the results.

    `backward_passes_per_step=N` (Horovod's meaning): N backward passes accumulate
    their gradients locally and the exchange happens on the N-th (with overlap, from
    the N-th pass's hooks); call `step()` after every N backwards. Gradients are summed
    over the passes, as in plain PyTorch: scale each loss by 1/N for the mean over the
    N micro-batches. `compression` (Horovod's `Compression.none/fp16` or hetrain's
    `Compression.int8/int4/auto`) must name the codec the job runs (`--codec`), since
    the summation servers decode with it; another one raises a UserError.
    To change gradients between the exchange and the update (clipping), as in Horovod:
    `opt.synchronize()`, clip, then `with opt.skip_synchronize(): opt.step()` (a step()
    after synchronize() never exchanges a second time).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, overlap: bool | None = None,
                 compression=None, backward_passes_per_step: int = 1):
        self._inner = optimizer
        if named_parameters is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named_parameters = [(f"param.{i}", p) for i, p in enumerate(params)]
        self._named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in self._named]
        if len(set(names)) != len(names):
            raise UserError("named_parameters has duplicate names; pass model.named_parameters()")
        if (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step < 1):
            raise UserError(f"backward_passes_per_step={backward_passes_per_step!r} must be an integer >= 1 "
                            "(the number of backward passes whose gradients accumulate before each step())")
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = [0] * len(self._named)  # backward passes seen per parameter this step
        self._batch_size = 1
        self._total: int | None = None  # every worker's batch together this step, when the loader knows it
        self._size_set = False  # set_batch_size() since the last step: zero_grad() starts the step
        self.engine = engine()
        if self.engine.ctx.distributed:  # the model on this worker's device (or the host), before any step
            check_tensors(self._named, self.engine.ctx.device, "DistributedOptimizer: parameter", model=True)
        self.sync = self.engine.ctx.comm.sync if self.engine.ctx.distributed else "sync"
        self.compression = self._check_compression(compression)
        self._async = None  # AsyncClient, made at the first step (after any checkpoint load)
        if overlap is None:  # the job's --overlap; all-reduce jobs overlap by default, as DDP does
            overlap = self.engine.ctx.comm.overlap or self.engine.ctx.comm.mode == "allreduce"
        self.overlap = bool(overlap) and self.sync == "sync"
        self._armed = False
        self._synced = False  # gradients of this step already exchanged (synchronize())
        self._skip = False
        self._hooks = []
        if self.overlap:
            index = {id(p): i for i, (_, p) in enumerate(self._named)}
            for _, p in self._named:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=index[id(p)]: self._grad_ready(i, param)))

    def _check_compression(self, compression) -> str:
        """The job's codec, after checking that `compression` asks for that one (the
        summation servers decode with the job's codec, so a different one per optimizer
        cannot be honoured)."""
        ctx = self.engine.ctx
        job = ctx.comm.codec
        if compression is None:
            return job
        name = _codec_name(compression)
        if not ctx.distributed:  # one process: nothing crosses a wire
            return name
        if name != job:
            what = ("" if name == "fp32" else
                    " (codecs need summation servers: --mode byteps, ps or colocated)" if ctx.comm.mode == "allreduce"
                    else "")
            raise UserError(f"DistributedOptimizer(compression={compression!r}) asks for codec {name!r} but this job "
                            f"runs codec {job!r}: codecs are a job setting, since the summation servers decode with "
                            f"them; launch with `hetrain launch --codec {name}`{what}, or drop compression=")
        return name

    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Backward produced parameter i's gradient: start pushing it now (after the
        last of `backward_passes_per_step` backward passes)."""
        if not self._armed:
            return
        self._passes[i] += 1
        if self._passes[i] > self.backward_passes_per_step:
            raise UserError(f"parameter {self._named[i][0]!r} got {self._passes[i]} gradients in one step but "
                            f"backward_passes_per_step={self.backward_passes_per_step}: call step() after every "
                            f"{self.backward_passes_per_step} backward passes, or raise backward_passes_per_step")
        if self._passes[i] < self.backward_passes_per_step:
            return  # accumulate locally; the exchange happens on the last pass
        if not self.engine.in_flight:
            if not self.engine.begin(self._named, weight=self._batch_size, overlapped=True,
                                     total=self._total):
                self._armed = False
                return
        if self.engine.is_ready(i):
            raise UserError(f"parameter {self._named[i][0]!r} got a second gradient in one step: overlap pushes each "
                            "gradient as soon as backward produces it; to accumulate gradients over several "
                            "backwards pass backward_passes_per_step=N (or drop --overlap)")
        self.engine.ready(i, param.grad)

    def __getattr__(self, item):  # delegate everything else (param_groups, state...)
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self._inner, item)

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    def set_batch_size(self, batch_size: int, total: int | None = None) -> None:
        """This worker's batch this step; `total`: every worker's together, when known
        (BalancedLoader passes it), which spares an all-reduce job the step header."""
        self._batch_size = int(batch_size)
        self._total = None if total is None else int(total)
        self._size_set = True  # zero_grad() after this starts the step at once
        if self._armed and not self.engine.in_flight:
            # overlap: exchange the step header now, before backward, so the hooks only
            # send (waiting for the other workers must not count as this worker's compute,
            # or the balancer would read waiting as slowness)
            if not self.engine.begin(self._named, weight=self._batch_size, overlapped=True,
                                     total=self._total):
                self._armed = False

    def synchronize(self) -> None:
        """Exchange the gradients now (Horovod's `synchronize`), e.g. to clip them before
        `with opt.skip_synchronize(): opt.step()`. step() does it unless it already happened
        this step."""
        if self.sync != "sync":
            raise UserError(f"synchronize() exchanges gradients synchronously but this job runs sync={self.sync!r}, "
                            "where step() pushes them to the parameter servers")
        _drain()
        named = []
        for n, p in self._named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            named.append((n, p.grad))
        self._armed = False
        if self.engine.in_flight:  # overlap: most partitions are already on their way
            self.engine.finish([t for _, t in named])
        else:
            self.engine.push_pull(named, weight=self._batch_size, total=self._total)
        self._passes = [0] * len(self._named)
        self._synced = True
        self._size_set = False
        self._total = None  # known for one step only

    @contextmanager
    def skip_synchronize(self):
        """`step()` inside this block runs the optimizer without exchanging gradients
        (call synchronize() first), e.g. to clip the averaged gradients in between."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if self.sync != "sync":  # async / bounded staleness: the servers run SGD on the pushes
            from ..comm.async_ps import AsyncClient

            loss = closure() if closure is not None else None
            group = self._inner.param_groups[0]
            if self._async is None:
                self._async = AsyncClient(self.engine.ctx, self._named, group["lr"], group.get("momentum", 0.0),
                                          batch=self._batch_size)
            self._async.step(lr=group["lr"], batch_size=self._batch_size)
            return loss
        if not self._skip and not self._synced:
            self.synchronize()
        elif self._skip and not self._synced and self.engine.ctx.distributed:
            raise UserError("step() inside skip_synchronize() needs synchronize() first: without it the workers' "
                            "gradients were never averaged")
        self._synced = False
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)
        self._armed = self.overlap
        self._synced = False
        self._passes = [0] * len(self._named)
        if self._armed and self._size_set and not self.engine.in_flight:
            # the batch size is known (BalancedLoader sets it before the loop's zero_grad):
            # start the step header now, so it runs during forward
            self.set_batch_size(self._batch_size, self._total)
        self._size_set = False

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner.load_state_dict(state_dict)
