"""Worker side of push_pull: the one entry point for every communication mode.

The engine checks what the user hands over, runs the step protocol (comm/protocol.py:
the announcement to the servers, or the all-reduced header), keeps the agreed layout
(comm/flatlayout.py) and, per step, a staging for the tensors' device (comm/staging/
for host tensors, comm/cuda.py for CUDA tensors) and the transport chosen once for this
worker (comm/transport.py). In every mode the result is the batch-weighted average
Σ b_i g_i / Σ b_i, so workers with different batch sizes produce the update one machine
would on the whole global batch.

An engine serves either the whole job's workers (`PushPull(ctx)`) or a subgroup of them
(`PushPull(ctx, group)`, comm/group.py: e.g. a pipeline stage's replicas). A subgroup
engine all-reduces among its members only (gloo, or NCCL where every member is a GPU of
its own); its step header, manifests and mismatch errors are the group's, naming its
members by their job ranks. One engine per group: the engines of different groups in
one process never share a collective.

Its parts live in comm/worker/: the step's book-keeping, weighting and accounting
(step.py), the agreed layout and what hangs on it (layouts.py: `LayoutKeeper`, a base of
`PushPull`), and the choice of staging per device (stagings.py).
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from ..errors import UserError
from ..runtime.commthreads import yield_loop_threads, yielding
from ..runtime.context import Context, init
from .buckets import BucketTuner
from .flatlayout import FlatLayout
from .group import Group
from .protocol import Announcer
from .staging import HostInPlace, Staging
from .transport import Arrival, make_transport
from .worker.layouts import LayoutKeeper
from .worker.stagings import staging_for
from .worker.step import CommStats, ExchangeOwner, _LazyScale, _Step, weigh

__all__ = ["CommStats", "ExchangeOwner", "PushPull", "_LazyScale"]

# How often, at most, a tensor handed over drives a staging or transport whose work
# completes asynchronously (`_Step.polls`, `Transport.polls`) when it completes no
# partition itself: a copy or a local reduce that finishes waits at most this long (and
# one gradient) for its next stage, and a model of many small tensors pays one pass per
# interval rather than one per gradient. Partitions complete in milliseconds; a pass
# costs microseconds.
POLL_S = 1e-4


class PushPull(LayoutKeeper):
    """One engine per group of workers (the job's, or a subgroup's): `push_pull`, or
    `begin` / `take` (or `ready`, for ranges) / `finish` for an exchange overlapped with
    backward.
    One exchange is in flight at a time; its owner completes it when another needs the
    engine. The agreed layout and its stagings are kept by `LayoutKeeper`."""

    def __init__(self, ctx: Context | None = None, group: Group | None = None):
        self.ctx = ctx or init()
        self.group = group
        if group is not None and not group.member:
            raise UserError(f"{self.ctx.describe(self.ctx.rank)} is not a member of {group.describe()}; make the "
                            "engine of a group only on its members")
        self.stats = CommStats()
        # a group of one (or a one-process job) moves nothing: only the weighting applies
        self.local = not self.ctx.distributed or (group is not None and group.size == 1)
        self.transport = make_transport(self.ctx, group) if not self.local else None
        servers = [p.rank for p in self.ctx.topology.servers] if self.ctx.topology and group is None else []
        self.protocol = Announcer(self.ctx, servers, self._new_layout, group) if not self.local else None
        self._layout: FlatLayout | None = None
        self._stagings: dict[torch.device, Staging] = {}
        self._cuda = None
        self._step: _Step | None = None
        self._memo: tuple | None = None  # (key of the tensors, (device, manifest, digest)): see _described
        self._tuner: BucketTuner | None = None  # the job's all-reduce buckets, while being tuned
        self._idle: weakref.WeakMethod | None = None  # see while_waiting
        self._step_mark: float | None = None  # see mark_step_start
        self._threads_set = False  # gloo's loop threads checked once more at the first exchange

    # ---- public -------------------------------------------------------------------------
    def push_pull(self, named: list[tuple[str, torch.Tensor]], weight: int = 1, average: bool = True,
                  total: int | None = None, speculate: bool = False) -> None:
        """Replace each tensor, in place, by the weighted average (or sum) over workers.

        `named` is in priority order: first = sent first (the input-side layers, needed
        first by the next forward pass). `weight` is this worker's batch size; `total`,
        when known, Σ of every worker's (see `begin`).
        """
        if not self.begin(named, weight, average, total=total, speculate=speculate):
            return
        order = range(len(named))
        if self.ctx.comm.overlap:  # same order as backward, which the servers expect
            order = reversed(order)
        for i in order:
            self.take(i, named[i][1])
        self.finish([t for _, t in named])

    def begin(self, named: list[tuple[str, torch.Tensor]], weight: int = 1, average: bool = True,
              overlapped: bool = False, arrival: Arrival | None = None, total: int | None = None,
              owner: ExchangeOwner | None = None, speculate: bool = False) -> bool:
        """Start a push_pull whose tensors will be handed over one by one with `ready`
        (e.g. from gradient hooks while backward runs) and collected by `finish`.

        `named` gives names, shapes and the device (the values are not read here).
        Returns False when there is nothing to move (a one-process job). `overlapped`
        says the tensors arrive while compute goes on, so only the time `finish` blocks
        counts as communication and the rest of the transfer time as hidden. `arrival`
        ("forward" or "backward", default: backward when overlapped) is the order in which
        the pieces will be handed over; collectives among workers follow it.

        `total` (all-reduce mode): the samples every worker's gradients cover together this
        step, when the caller knows it (BalancedLoader agrees on every worker's share):
        each worker scales by weight / total. It is Σ weights, except where a worker's
        gradient also carries samples claimed after its weight was set (BalancedLoader's
        dynamic tail, which scales those by 1 / weight like the rest). With the layout the
        workers agreed on, the step then needs no header collective at all, as in DDP:
        the buckets are its only collectives.
        Only a tensor list that changes on one worker mid-job is not named then: its
        collectives time out, or gloo aborts the processes whose bucket sizes disagree.

        `owner`: who can complete this exchange (`ExchangeOwner`). One exchange is in
        flight at a time (its layout, staging and collectives are the step's); a begin
        while an owned one is in flight first has its owner complete it, as a second
        optimizer's step or a push_pull of the loss between backward and step() need.

        `speculate` (all-reduce mode, the agreed layout, no `total`): a standalone call
        with no forward pass to hide the step header behind. Each worker sends b_i·x at
        once, the header runs beside the buckets (on a process group of its own in a
        whole-job engine), and `finish`
        checks it and divides the sums by Σb: one round trip instead of two. Every worker
        must pass the same value (the API's push_pull calls always do), since workers
        scaling by b_i and by b_i / Σb cannot be summed together. Only the layout in use
        speculates: workers sending buckets of two layouts would abort in gloo (its size
        check) before the header could name the mismatch; and only float32/float64 ones
        (`wide_floats`: float16 may not hold the sum of b_i·x that the average fits in).
        """
        self.complete_other(owner)
        if weight < 0 or int(weight) != weight:
            raise UserError(f"push_pull weight must be a non-negative integer batch size, got {weight!r}")
        ctx = self.ctx
        if ctx.distributed and not ctx.comm.synchronous and self.group is None:
            raise UserError(f"push_pull is synchronous but this job runs sync='{ctx.comm.sync}'; use "
                            "hetrain.DistributedOptimizer, which pushes to and pulls from the parameter servers")
        if self.group is None or not self.local:  # (a set of one worker: the optimizer's tensors, checked there)
            device, manifest, digest = self._described(named)
        t0 = time.perf_counter()
        if self.local:  # one process: the weighted average of one worker is itself
            if average and weight == 0:
                raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
            self.stats.account(time.perf_counter() - t0, 0.0, 0, 0.0)
            return False
        weight = int(weight)
        w = weigh(self.transport, self.protocol, named, device, manifest, digest, weight, average, total, speculate)
        staging = self._staging_for(device)
        staging.begin(w.scale)
        self.transport.begin(staging, self.protocol.epoch, overlapped, arrival)
        t1 = time.perf_counter()
        self._step = _Step(staging, wait_s=t1 - t0, t_begin=t1, done=[False] * len(named),
                           covered=[0] * len(named), overlapped=overlapped,
                           control=w.control, manifest=manifest, weight=weight, average=average, total=w.total,
                           owner=owner, header=w.header, polls=staging.polled)
        return True

    def owned_by(self, owner: object) -> bool:
        """An exchange is in flight and `owner` began it."""
        return self._step is not None and self._step.owner is owner

    def complete_other(self, caller: object | None = None) -> None:
        """Have the exchange in flight completed by its owner, unless `caller` owns it
        (nothing in flight: nothing to do). Every worker runs its exchanges in the same
        order, so completing one early changes no collective's order."""
        st = self._step
        if st is None or (caller is not None and st.owner is caller):
            return
        if st.owner is None:
            raise UserError("push_pull.begin() called while another push_pull is in flight; call finish() first")
        st.owner.complete_exchange()
        if self._step is st:  # pragma: no cover - an owner's complete_exchange always finishes it
            raise RuntimeError("the owner of the exchange in flight did not complete it")

    def take(self, index: int, tensor: torch.Tensor, owner: ExchangeOwner | None = None) -> bool | None:
        """Tensor `index` of `owner`'s push_pull in flight is final (a gradient hook, or
        push_pull's own loop): count it in where it is its gradient home (`grad_homes`),
        else stage it whole, and post every partition it completes. The one call per
        gradient: the staging records it, and the transport is driven only when a
        partition is complete (or, at most every POLL_S, where it has asynchronous work to
        poll: `_Step.polls`, `Transport.polls`).
        Never blocks. None: no push_pull of `owner` is in flight (nothing done); False:
        tensor `index` was handed over already this step."""
        st = self._step
        if st is None or st.owner is not owner:
            return None
        if st.done[index]:
            return False
        if st.covered[index]:
            raise UserError(f"push_pull: tensor {index} was handed over in ranges; hand over the rest of it with "
                            "ready(index, tensor, lo, hi)")
        staging = st.staging
        pids = staging.arrived(index, tensor) if staging.keeps_homes else None
        if pids is None:
            pids = staging.fill(index, tensor, 0, tensor.numel())
        st.done[index] = True
        st.covered[index] = tensor.numel()
        if pids:
            self.transport.filled(pids)
        if pids or ((st.polls or self.transport.polls) and time.perf_counter() >= st.poll_at):
            self.transport.progress()
            st.poll_at = time.perf_counter() + POLL_S
        return True

    def handed_over(self) -> list[bool]:
        """Per tensor of the push_pull in flight, whether it was handed over already (all
        False where none is in flight): one call per step, not one per tensor."""
        return list(self._step.done) if self._step is not None else []

    def ready(self, index: int, tensor: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Elements [lo, hi) (default: all) of tensor `index` of the current push_pull are
        final: stage them and post every partition they complete (overlap: called from a
        gradient hook, so this never blocks and never synchronises with the GPU).

        Tensors must stay untouched until finish() returns: partitions are sent from them
        and results written into them where possible."""
        st = self._step
        if st is None or st.done[index]:
            return
        n = tensor.numel()
        hi = n if hi is None else hi
        if not (0 <= lo < hi <= n or lo == hi == n == 0):
            raise UserError(f"push_pull.ready: range [{lo}, {hi}) is outside tensor {index} of {n} elements")
        st.covered[index] += hi - lo
        st.done[index] = st.covered[index] >= n
        pids = st.staging.fill(index, tensor, lo, hi)
        if pids:
            self.transport.filled(pids)
        if pids or ((st.polls or self.transport.polls) and time.perf_counter() >= st.poll_at):
            self.transport.progress()
            st.poll_at = time.perf_counter() + POLL_S

    def finish(self, tensors: list[torch.Tensor]) -> None:
        """Send what is left, wait for every sum and write the results into `tensors`."""
        st = self._step
        if st is None:
            return
        if not self._threads_set:  # a group's loop thread named only after init() looked (commthreads.py)
            self._threads_set = True
            yield_loop_threads()
        t_fin = time.perf_counter()
        try:
            for i, t in enumerate(tensors):
                if not st.done[i]:
                    if st.covered[i]:
                        raise UserError(f"push_pull: only {st.covered[i]} of {t.numel()} elements of tensor {i} "
                                        "were handed over before finish()")
                    self.take(i, t, st.owner)
            if st.control is not None:
                st.total = self.protocol.answers(st.control, st.manifest, st.weight)
            st.staging.resolve()  # all-reduce: the step header is checked even with no bucket
            if st.header is not None:  # before the sums: a mismatch it names would leave them hanging
                st.total = st.header()
            self.transport.finish(idle=self._idle_task())
            st.staging.complete(tensors)
            if st.header is not None and st.average and st.total > 0:
                for t in tensors:
                    t.div_(st.total)
            if st.average and st.total == 0:
                raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
        finally:
            self._step = None
        began, self._step_mark = (self._step_mark or st.t_begin), None
        self._tune_buckets(began, not isinstance(st.staging, HostInPlace))
        end = time.perf_counter()
        tr = self.transport
        if st.overlapped:
            span = max(tr.t_last, t_fin) - min(tr.t_first or t_fin, t_fin)
            exposed = end - t_fin
            hidden = max(0.0, span - exposed)
        else:
            exposed, hidden = end - st.t_begin, 0.0
        self.stats.account(st.wait_s, exposed, tr.bytes_out, hidden, tr.bytes_in)

    def mark_step_start(self) -> None:
        """The training step starts now (the optimizer's zero_grad): the bucket tuner
        times each step from here to the end of its exchange, the same span whether the
        push_pull begins at once (overlap) or at step() (a one-bucket plan)."""
        self._step_mark = time.perf_counter()

    def while_waiting(self, task: Callable[[], None]) -> None:
        """Run `task` in each step's exchange once every bucket is on its way, before the
        wait (all-reduce jobs; a bound method, held weakly, replacing the one before): work
        needing no result of this step takes the time the wait would idle (re-planning)."""
        self._idle = weakref.WeakMethod(task)

    def _idle_task(self) -> Callable[[], None] | None:
        """The task for this step's wait, unless the wait is not idle: where gloo's socket
        thread yields to this process's threads (runtime/commthreads.py), work done in
        the wait delays the exchange itself (docs/hps.md has the figures), so the task
        then runs where it would without a wait."""
        if self._idle is None or yielding():
            return None
        return self._idle()

    def is_ready(self, index: int) -> bool:
        """Whether tensor `index` of the push_pull in flight was already handed over."""
        return self._step is not None and self._step.done[index]

    def carry(self, row):
        """`row` rides this engine's next step (`Transport.carry`, comm/cargo.py), or None."""
        return self.transport.carry(row) if self.transport is not None else None

    @property
    def in_flight(self) -> bool:
        return self._step is not None

    def shutdown(self) -> None:
        """Tell the summation servers the job is over (every worker calls this once)."""
        ctx = self.ctx
        if self.local or self.group is not None or not ctx.topology.servers or ctx.failed:
            return
        if not ctx.comm.synchronous:
            from .async_ps import send_stop

            send_stop(ctx)
            return
        self.protocol.stop()

    # ---- internals ----------------------------------------------------------------------
    def _staging_for(self, device: torch.device) -> Staging:
        st = self._stagings.get(device)
        if st is None:
            st, self._cuda = staging_for(self.ctx, self.transport, self._layout, device, self._cuda)
            self._stagings[device] = st
        return st
