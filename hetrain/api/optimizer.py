"""DistributedOptimizer: the wrapped optimizer whose step() first averages gradients
over the workers (Horovod's `optimizer`).

`DistributedOptimizer(opt)` returns an object of a class made for `type(opt)`, a subclass
of both DistributedOptimizer and `type(opt)` (Horovod does the same), so it *is* an
`torch.optim.SGD` (or Adam...) for isinstance checks, LR schedulers and checkpoint code,
while step(), zero_grad(), state_dict() and the parameter groups are the wrapped
optimizer's, reached through the wrapper."""
from __future__ import annotations

import torch

from ..comm.layout import check_tensors
from ..errors import UserError
from ..modes import CodecChoice, Sync
from . import uneven as _join
from .amp import scaled_step
from .basics import engine
from .grad_hooks import GradHooks
from .grad_sync import GradientSync
from .members import ExchangeMembers
from .compression import _codec_name
from .reduce_op import ReduceOp, resolve

_CLASSES: dict[type, type] = {}  # wrapped optimizer class -> its DistributedOptimizer class


def _class_for(inner: type) -> type:
    """The DistributedOptimizer class for optimizers of class `inner` (made once)."""
    cls = _CLASSES.get(inner)
    if cls is None:
        cls = type(inner.__name__, (DistributedOptimizer, inner),
                   {"__module__": DistributedOptimizer.__module__, "__qualname__": inner.__qualname__,
                    "__doc__": DistributedOptimizer.__doc__})
        _CLASSES[inner] = cls
    return cls


def _check_groups(groups, num_groups, named) -> None:
    """Horovod's `groups=`/`num_groups=` say which gradients to fuse into one all-reduce.
    hetrain's engine already moves all gradients of a step as one flat layout cut into
    partitions, so the grouping changes nothing it does; it is checked, not applied."""
    if num_groups and (isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0):
        raise UserError(f"num_groups={num_groups!r} must be a non-negative integer")
    if groups is None:
        return
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise UserError(f"groups={groups} must be >= 0")
        return
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise UserError("groups= takes a number of groups or a list of lists of parameters")
    known = {id(p) for _, p in named}
    for g in groups:
        for p in g:
            if id(p) not in known:
                raise UserError("groups= names a parameter that this optimizer does not train")


class DistributedOptimizer(GradHooks, GradientSync, torch.optim.Optimizer):
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

    Horovod's options: `op=hetrain.Average` (default), `hetrain.Sum` (the sum of the
    workers' gradients) or `hetrain.Adasum` (each worker steps the wrapped optimizer on
    its own gradients and the workers' parameter updates are combined by Adasum, as
    Horovod's Adasum optimizer does; no overlap). `gradient_predivide_factor=f` (Average
    only) divides the gradients by f before the exchange and multiplies by f after, to
    keep low-precision sums in range. `groups=`/`num_groups=` are checked and accepted (the
    engine fuses all gradients anyway). Sparse gradients (nn.Embedding(sparse=True)) need
    `sparse_as_dense=True`, which densifies them before the exchange.
    A `torch.amp.GradScaler` works with it (api/amp.py): every worker agrees on inf/NaN.
    """

    _step_supports_amp_scaling = True  # scaler.step(opt) calls step(grad_scaler=...): api/amp.py

    def __new__(cls, optimizer=None, *args, **kwargs):
        if cls is DistributedOptimizer:
            if isinstance(optimizer, DistributedOptimizer):
                raise UserError("DistributedOptimizer: this optimizer is already a DistributedOptimizer; wrap the "
                                "plain optimizer once")
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise UserError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
            cls = _class_for(type(optimizer))
        return object.__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                 backward_passes_per_step: int = 1, op=None, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups=None, sparse_as_dense: bool = False, process_set=None, *,
                 overlap: bool | None = None):
        self._inner = optimizer
        self.op = resolve(op, None, "DistributedOptimizer")
        if self.op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
            raise UserError(f"DistributedOptimizer(op={self.op!r}): gradients combine by hetrain.Average, Sum or "
                            "Adasum")
        if gradient_predivide_factor != 1.0 and self.op != ReduceOp.AVERAGE:
            raise UserError("gradient_predivide_factor is only for op=hetrain.Average (as in Horovod)")
        if not gradient_predivide_factor > 0:
            raise UserError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be > 0")
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise UserError("DistributedOptimizer: process sets are not supported; gradients are exchanged among "
                            "all workers")
        self._predivide = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        if named_parameters is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named_parameters = [(f"param.{i}", p) for i, p in enumerate(params)]
        self._named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in self._named]
        if len(set(names)) != len(names):
            raise UserError("named_parameters has duplicate names; pass model.named_parameters()")
        _check_groups(groups, num_groups, self._named)
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._batch_size = 1
        self._total: int | None = None  # every worker's batch together this step, when the loader knows it
        self._size_set = False  # set_batch_size() since the last step: zero_grad() starts the step
        self.engine = engine()  # the engine of this step's exchange (see set_exchange)
        self._members = ExchangeMembers(self.engine, self._named, optimizer)
        self._out = False  # this worker sits this step's exchange out (set_exchange)
        if self.engine.ctx.distributed:  # the model on this worker's device (or the host), before any step
            check_tensors(self._named, self.engine.ctx.device, "DistributedOptimizer: parameter", model=True)
        self.sync = self.engine.ctx.comm.sync if self.engine.ctx.distributed else Sync.SYNC
        self.compression = self._check_compression(compression)
        self._async = None  # AsyncClient, made at the first step (after any checkpoint load)
        if overlap is None:  # the job's --overlap; all-reduce jobs overlap by default, as DDP does
            overlap = self.engine.ctx.comm.overlap or not self.engine.ctx.comm.has_servers
        self.overlap = bool(overlap) and self.sync.synchronous and self.op != ReduceOp.ADASUM
        self._armed = False
        self._synced = False  # gradients of this step already exchanged (synchronize())
        self._skip = False
        self._announced = False  # this step's exchange announced to joined workers: see _announce
        self._join_index = _join.register_optimizer(self)
        self._covers: tuple[int, bool] | None = None  # see _covers_all_params
        self._hooks = self._register_hooks() if self.overlap else []

    def _check_compression(self, compression) -> CodecChoice:
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
            what = ("" if not name.coded else
                    " (codecs need summation servers: --mode byteps, ps or colocated)" if not ctx.comm.has_servers
                    else "")
            raise UserError(f"DistributedOptimizer(compression={compression!r}) asks for codec '{name}' but this job "
                            f"runs codec '{job}': codecs are a job setting, since the summation servers decode with "
                            f"them; launch with `hetrain launch --codec {name}`{what}, or drop compression=")
        return name

    @property
    def _average(self) -> bool:
        return self.op == ReduceOp.AVERAGE

    def __getattr__(self, item):  # delegate everything else (defaults, hooks, ...) to the wrapped optimizer
        if item == "_inner":
            raise AttributeError(item)
        return getattr(self._inner, item)

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    def add_param_group(self, param_group) -> None:
        raise UserError("add_param_group on a DistributedOptimizer: its gradients would not be exchanged; add the "
                        "group to the wrapped optimizer before wrapping it")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's `set_backward_passes_per_step`: how many backward passes accumulate
        locally before each exchange (takes effect from the next step)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise UserError(f"backward_passes_per_step={passes!r} must be an integer >= 1 "
                            "(the number of backward passes whose gradients accumulate before each step())")
        self.backward_passes_per_step = passes
        self._passes = [0] * len(self._named)  # backward passes seen per parameter this step

    def set_batch_size(self, batch_size: int, total: int | None = None) -> None:
        """This worker's batch this step; `total`: every worker's together, when known
        (BalancedLoader passes it), which spares an all-reduce job the step header.
        Passing `total` also says that every worker takes this step (BalancedLoader's
        contract), so the exchange is not announced to workers that called
        `hetrain.join()`: with a total, no collective runs besides the buckets."""
        self._batch_size = int(batch_size)
        self._total = None if total is None else int(total)
        self._size_set = True  # zero_grad() after this starts the step at once
        if self._armed and not self.engine.in_flight and not self._out:
            # overlap: exchange the step header now, before backward, so the hooks only
            # send (waiting for the other workers must not count as this worker's compute,
            # or the balancer would read waiting as slowness)
            if not self._announce() or not self.engine.begin(self._named, weight=self._batch_size,
                                                             average=self._average, overlapped=True,
                                                             total=self._total, owner=self):
                self._armed = False

    def set_exchange(self, workers=None, *, step: bool = True) -> None:
        """This step's exchange runs among `workers` only (indices into the job's workers;
        None: all of them), the workers that train on samples in it (BalancedLoader says
        so every step, before `set_batch_size`; api/members.py). Every worker must call it
        at the same step with the same set. A worker outside it sits the step out: no
        exchange, no update (its parameters stand still until a set takes it in again,
        when they and the optimizer state are first broadcast to it from a worker that
        kept training). Sync jobs with op Average or Sum; otherwise every worker exchanges.
        `step=False`: no step follows (the end of training: every worker is brought up to date)."""
        can = self.sync.synchronous and self.op != ReduceOp.ADASUM
        eng = self._members.switch(workers if can else None, self.engine.in_flight, self._named, self._inner, step)
        self._out = eng is None
        self.engine = self._members.job if eng is None else eng

    def track_buffers(self, model: torch.nn.Module) -> None:
        """`model`'s buffers (batch-norm statistics...) are re-synchronised with the
        parameters and the optimizer state where a worker rejoins the exchange
        (`set_exchange`; BalancedLoader(model=...) calls this)."""
        self._members.track(model)

    def step(self, closure=None, grad_scaler=None):
        if closure is not None and not self._synced:
            # a closure recomputes the loss (forward and backward, PyTorch's contract): its
            # gradients exist only after it ran, so it runs before they are exchanged
            # (Lightning's automatic optimization calls step(closure))
            with torch.enable_grad():
                loss = closure()
            self.step(grad_scaler=grad_scaler)
            return loss
        if grad_scaler is not None:
            return scaled_step(self, grad_scaler, closure)
        if not self.sync.synchronous:  # async / bounded staleness: the servers run SGD on the pushes
            from ..comm.async_ps import AsyncClient

            loss = closure() if closure is not None else None
            group = self._inner.param_groups[0]
            if self._async is None:
                self._async = AsyncClient(self.engine.ctx, self._named, group["lr"], group.get("momentum", 0.0),
                                          batch=self._batch_size)
            self._async.step(lr=group["lr"], batch_size=self._batch_size)
            return loss
        if self.op == ReduceOp.ADASUM:
            return self._adasum_step(closure)
        if self._out:  # sitting out: the parameters stand still until it rejoins (re-synchronised then)
            self._synced = False
            self._passes = [0] * len(self._named)
            for _, p in self._named:
                p.grad = None  # nothing to apply: the wrapped step below passes over every parameter
            # The wrapped step still runs, on no gradients, so whatever hooks its end sees this
            # step as every other worker does: the balanced loader's step count (which decides
            # when every worker commits; a worker counting one step fewer would skip a commit
            # the others make and hang them), a learning-rate schedule.
            return self._inner.step(closure)
        if not self._skip and not self._synced:
            self.synchronize()
        elif self._skip and not self._synced and self.engine.ctx.distributed:
            raise UserError("step() inside skip_synchronize() needs synchronize() first: without it the workers' "
                            "gradients were never averaged")
        self._synced = False
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; then, on a host all-reduce job, gradients that
        fit one all-reduce bucket are pointed at their piece of it, zeroed (PyTorch DDP's
        `gradient_as_bucket_view`): backward accumulates into the bucket, and neither a copy
        in nor a copy out is made. Such a `.grad` is a zero tensor, not None, after this."""
        if self._out:
            self._inner.zero_grad(set_to_none=set_to_none)
            self._armed = self._synced = self._size_set = False
            self._passes = [0] * len(self._named)
            return
        if not self.engine.in_flight:
            self.engine.mark_step_start()
        homes = ({} if not self.sync.synchronous or self.op == ReduceOp.ADASUM or self.engine.in_flight
                 else self.engine.grad_homes(self._named))
        if not self._all_at_home(homes):
            self._inner.zero_grad(set_to_none=set_to_none)
        if homes:
            self.engine.zero_grad_homes()
            named = self._named
            for i, view in homes.items():
                if named[i][1].grad is not view:
                    named[i][1].grad = view
        # overlap hands gradients over from backward's hooks, unless the agreed layout is
        # one all-reduce bucket: it could start no earlier than the last gradient, so the
        # exchange then runs at step() and the hooks return at once; nor where nothing
        # moves (one process, or a set of one worker: `PushPull.local`)
        self._armed = self.overlap and not self.engine.single_bucket and not self.engine.local
        self._synced = False
        self._passes = [0] * len(self._named)
        if self._armed and self._size_set and not self.engine.in_flight:
            # the batch size is known (BalancedLoader sets it before the loop's zero_grad):
            # start the step header now, so it runs during forward
            self.set_batch_size(self._batch_size, self._total)
        self._size_set = False

    def _all_at_home(self, homes: dict[int, torch.Tensor]) -> bool:
        """Every gradient the wrapped optimizer would reset lives in its bucket already, so
        zeroing the buckets is the whole of zero_grad (the wrapped optimizer's own would set
        each to None, only for this optimizer to point it back). Only for the stock
        `Optimizer.zero_grad`: a subclass's own zero_grad always runs."""
        if not homes or type(self._inner).zero_grad is not torch.optim.Optimizer.zero_grad:
            return False
        if len(homes) != len(self._named) or not self._covers_all_params():
            return False
        named = self._named
        return all(named[i][1].grad is view for i, view in homes.items())

    def _covers_all_params(self) -> bool:
        """The wrapped optimizer's parameters are exactly the exchanged ones (checked once
        per count of its parameters)."""
        groups = self._inner.param_groups
        count = sum(len(g["params"]) for g in groups)
        if self._covers is None or self._covers[0] != count:
            mine = {id(p) for g in groups for p in g["params"]}
            self._covers = (count, mine == {id(p) for _, p in self._named})
        return self._covers[1]

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner.load_state_dict(state_dict)
