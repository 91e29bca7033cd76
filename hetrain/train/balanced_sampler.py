"""This worker's indices for every step, balanced by measured speed: the part of
`BalancedLoader` that decides who trains on which samples (the shares, their measurement
and exchange, the dynamic tail) without loading anything. `BalancedLoader`
(`hetrain.train.loader`) fetches what it yields; `BalancedBatchSampler` gives the same
index lists to a user's own `DataLoader`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from ..errors import UserError
from ..perf.steptime import spread
from .balance import BalanceConfig, Balancer
from .pace import SitOutPace
from .set_times import SetPeriods
from .exchange_price import host_allreduce
from .exchange import Gather, worker_gather
from .position import DataPosition
from .sampler import GlobalBatchSampler
from .stepclock import StepClock, StepRecords
from .tail import TailClaims, split_tail

__all__ = ["BalancedBatchSampler", "WorkerGroup", "METRICS"]

# the numbers every worker contributes per step (gathered with the step-time fit)
METRICS = ("samples", "compute_s", "comm_s", "wait_s", "hidden_s", "bytes")


@dataclass(frozen=True)
class WorkerGroup:
    """Who takes part: this worker's index, how many workers, and how one float64 row per
    worker is all-gathered. Default: this hetrain job's workers (`hetrain.init()`);
    tests and custom launchers can pass their own."""

    rank: int
    size: int
    gather: Gather  # gather(row) starts the exchange and returns wait() -> (workers x len(row))
    labels: tuple[str, ...] = ()
    store: object | None = None  # a torch.distributed Store the workers share (tail= claims its chunks there)


def _job_group(ctx) -> WorkerGroup:
    labels = tuple(ctx.topology.worker_labels) if ctx.topology else ("w0",)
    return WorkerGroup(ctx.rank if ctx.distributed else 0, ctx.num_workers,
                       worker_gather(ctx, "exchanging step times"), labels, ctx.store if ctx.distributed else None)


def _job_device(ctx) -> torch.device:
    """This worker's device (`hetrain.device()`: cuda:<local rank> on a machine with
    `cuda: true`, else the CPU)."""
    return getattr(ctx, "device", None) or torch.device("cpu")


def _zero_stats() -> tuple[float, float, float, float]:
    return 0.0, 0.0, 0.0, 0.0


class BalancedBatchSampler(DataPosition, torch.utils.data.Sampler):
    """This worker's indices for every step of an epoch, balanced by measured speed.

    Arguments as for `BalancedLoader` (without the loading ones); `num_samples` is the
    dataset's length. Iterating gives lists of indices; `len()` is the number of steps.
    """

    def __init__(self, num_samples: int, global_batch: int, *, seed: int = 0, optimizer=None,
                 device: torch.device | None = None, drop_last: bool = False,
                 balance: Literal["measured", "equal"] = "measured", config: BalanceConfig | None = None,
                 memory_per_sample: float = 0.0, reserved_bytes: float = 0.0, logger=None,
                 max_samples: Sequence[int] | None = None, group: WorkerGroup | None = None, ctx=None,
                 strategy: Literal["auto", "unequal", "accumulate"] | None = None, micro_batch: int | None = None,
                 tail: float | None = None):
        if num_samples < 1:
            raise UserError(f"the dataset is empty (0 samples); BalancedLoader needs at least {global_batch}")
        if global_batch < 1:
            raise UserError(f"global_batch must be >= 1 sample, got {global_batch}")
        job = group is None  # the job's workers: the balancer's rows may ride the optimizer's all-reduce
        if group is None:
            if ctx is None:
                from ..runtime.context import init
                ctx = init()
            group = _job_group(ctx)
        self.ctx = ctx
        self.group = group
        if global_batch < group.size:
            raise UserError(f"global_batch {global_batch} is smaller than the {group.size} workers; raise it to at "
                            f"least {group.size} so every worker gets a sample")
        self.device = device if device is not None else _job_device(ctx)
        self.drop_last = drop_last
        self.sampler = GlobalBatchSampler(num_samples, global_batch, group.size, seed=seed)
        if drop_last and num_samples < global_batch:
            raise UserError(f"drop_last=True with {num_samples} samples and a global batch of {global_batch} leaves "
                            "no step; lower the global batch or keep the last partial batch")
        # async / bounded staleness: equal shares, no per-step collective (it would put
        # the workers in lock-step)
        lockstep = ctx is None or not ctx.distributed or ctx.comm.synchronous
        base = config or BalanceConfig()
        cfg = BalanceConfig(**{**base.__dict__, "policy": balance if lockstep else "equal",
                               "memory_per_sample": memory_per_sample or base.memory_per_sample,
                               "reserved_bytes": reserved_bytes or base.reserved_bytes,
                               "strategy": strategy or base.strategy,
                               "micro_batch": base.micro_batch if micro_batch is None else micro_batch,
                               "tail": base.tail if tail is None else tail})
        self.claims = None  # the dynamic tail's claims (hetrain.train.tail), when tail > 0 and workers > 1
        if cfg.tail > 0 and lockstep and group.size > 1:
            if ctx is not None and ctx.distributed and ctx.comm.has_servers:
                # summation servers divide by the announced batch sizes, not the step's samples
                raise UserError(f"tail= needs --mode allreduce (this job runs mode '{ctx.comm.mode}', whose "
                                "summation servers weight each worker by the batch size it announced before "
                                "claiming); or set tail=0")
            if group.store is None:
                raise UserError("tail= needs a store the workers share (the job's, under `hetrain launch`); this "
                                "worker group has none: pass WorkerGroup(store=...) or set tail=0")
        self.balancer = Balancer(ctx, global_batch, cfg, device=self.device, gather=group.gather, caps=max_samples,
                                 num_workers=group.size, labels=list(group.labels) or None, lockstep=lockstep)
        if cfg.tail > 0 and lockstep and group.size > 1:  # a worker is fewer than 2 exchanges ahead of another
            self.claims = TailClaims(group.store, group.rank, lag=2 * self.balancer.exchange_every + 4)
        self._batch: np.ndarray | None = None  # the global batch of the step handed out (its tail is claimed)
        self._cut_for: tuple | None = None  # (sizes, where this worker's samples lie): see _cut
        self.optimizer = optimizer
        self.engine = getattr(optimizer, "engine", None)
        if job and hasattr(self.engine, "carry"):
            self.balancer.carry = self.engine.carry  # rides the job's exchange only: every worker's row
        # a worker with no samples in a step leaves its exchange (api/members.py); the tail
        # is claimed while the step runs, so who takes part is not known when it starts
        self.leave = (job and lockstep and cfg.leave and self.claims is None and group.size > 1
                      and hasattr(optimizer, "set_exchange"))
        # a worker out is probed on copies of samples, staying out of the exchange (its
        # optimizer drops the gradients of a step it sits out): a probe costs the workers
        # in no exchange with it, no re-synchronisation, none of their samples
        self.balancer.shadow_probes = self.leave
        if self.leave:  # a set of workers not measured yet is priced by the cost model where it can be
            self.balancer.prices.short = host_allreduce(ctx, [p for g in optimizer.param_groups for p in g["params"]])
        # the step handed out last's exchange, what it costs this worker measured by kind
        # (True: every worker in it; False: a set short of the job; None: not measured)
        self._shared: bool | None = None
        self._alone = False  # the step handed out last has one worker with samples (see _begin)
        self.logger = logger
        self._running = 0  # the step handed out last (its index in the epoch)
        self.micro = 0  # this worker's micro-batch in the step handed out last (0: one pass)
        self.spreads: list[float] = []  # measured compute spread (max/min over workers) per step
        self.last_rows: np.ndarray | None = None
        self.exchange_s = 0.0  # time spent in the per-step exchange (waiting for the others included)
        self._open: tuple | None = None  # (samples, start mark, stats at start) of the step handed out
        self.clock = StepClock(torch.device(self.device))  # a step's time on the device (train/stepclock.py)
        # closed steps' compute, recorded in order, and the row each exchange carries
        self.steps = StepRecords(self.clock, lambda samples, seconds: self.balancer.record(samples, seconds))
        self._hook_end: tuple | None = None
        self.periods = SetPeriods(self.balancer.n, self.balancer.record_period)
        self.pace = SitOutPace(self.balancer.set_times)  # a worker sitting out keeps to the trainers' pace
        # the batch handed out last is a probe's copies of samples others train on, this
        # worker out of the exchange and its gradients dropped (`Balancer.step_plan`)
        self.copies = False
        self._hook = None  # handle of the step post-hook on the wrapped optimizer

    def _ensure_hook(self) -> None:
        """Hook the end of `optimizer.step()` (the wrapped optimizer's step post-hook):
        the step's compute ends there, before any logging or evaluation the loop does."""
        if self._hook is None and self.optimizer is not None:
            inner = getattr(self.optimizer, "_inner", self.optimizer)
            if hasattr(inner, "register_step_post_hook"):
                self._hook = inner.register_step_post_hook(self._on_step)

    # -- measurement
    def _stats(self) -> tuple[float, float, float, float]:
        st = getattr(self.engine, "stats", None)
        if st is None:
            return _zero_stats()
        return st.comm_s, st.wait_s, getattr(st, "hidden_s", 0.0), float(st.bytes_sent + st.bytes_received)

    def _on_step(self, *_args) -> None:
        if self._open is not None and self._hook_end is None:
            self._hook_end = (self.clock.mark(), self._stats())
            self.sampler.step = self._running + 1  # the update is applied: a commit from here resumes after it

    def _begin(self, samples: int, total: int | None = None, passes: int = 1, members=None) -> None:
        self._ensure_hook()
        if self.engine is not None and hasattr(self.engine, "while_waiting"):
            self.engine.while_waiting(self.balancer.prefetch)  # re-plan while the step's exchange waits
        # a worker out of the step's set (a probe's: its samples are copies, its gradients dropped)
        inside = samples if not self.leave or members is None or self.group.rank in members else 0
        if self.leave:  # the workers with samples exchange among themselves (every worker agrees)
            self.optimizer.set_exchange(members)
            self._shared = self.balancer.prices.kind_of(members, inside)
        # one worker trains this step, the others out of its exchange: the balancer's own
        # exchange may wait longer (FitExchange._every; the same on every worker)
        self._alone = self.leave and members is not None and len(members) == 1
        if self.optimizer is not None and hasattr(self.optimizer, "set_batch_size"):
            self.optimizer.set_batch_size(samples, total=total)
        if self.optimizer is not None and hasattr(self.optimizer, "backward_passes_per_step"):
            # accumulating: the exchange starts on this worker's last micro-batch
            self.optimizer.backward_passes_per_step = max(1, passes)
        self._hook_end = None
        if self.leave:
            # sitting out: at half the trainers' pace, not in bursts that take their cores (train/pace.py)
            self.pace.begin(samples == 0, members, self.balancer.step)
            # the step before, start to start, for its set's measured step (train/set_times.py)
            self.periods.begin(time.perf_counter(), inside, members,
                               total == self.balancer.global_batch and not self.balancer.probing)
        self._open = (samples, self.clock.mark(), self._stats())

    def _end(self) -> None:
        """Close the step handed out last: measure it, exchange, re-balance, log."""
        if self._open is None:
            return
        samples, t_out, s0 = self._open
        if self.claims is not None:
            samples += self.claims.claimed
            self.claims.end()
        end, s1 = self._hook_end if self._hook_end is not None else (self.clock.mark(), self._stats())
        self._open = self._hook_end = None
        comm, wait, hidden, nbytes = (b - a for a, b in zip(s0, s1))
        if self._shared is not None:  # what sharing the exchange cost this step (hetrain.perf.exchangeset)
            self.balancer.record_exchange(comm + wait, whole=self._shared)
        row = self.steps.close((samples, t_out, end, comm, wait, hidden, nbytes))
        t0 = time.perf_counter()
        self.balancer.update(extra=row, alone=self._alone)
        self.exchange_s += time.perf_counter() - t0
        self._log()

    def finish(self) -> None:
        """End of training (every worker, same point): close the step handed out last if
        the loop was left early, and complete the exchange still in flight, so the last
        step is measured, logged and counted; and bring every worker's parameters up to
        date (a worker that sat out the last steps, out of their exchange, has older ones:
        api/members.py). A collective."""
        self._end()
        self.steps.settle()  # the last step's device time, where it was held (the exchanges are over)
        t0 = time.perf_counter()
        self.balancer.flush()
        if self.leave:  # every worker's parameters the same again (a worker sitting out has old ones)
            self.optimizer.set_exchange(None, step=False)
        self.exchange_s += time.perf_counter() - t0
        self._log()
        if self._hook is not None:  # iterating again re-installs it
            self._hook.remove()
            self._hook = None

    def _log(self) -> None:
        rows = self.balancer.rows
        if rows is None:
            return
        self.last_rows = rows
        self.spreads.append(spread(rows[:, 1], rows[:, 0]))
        if self.logger is not None:
            self.logger.write(self.balancer.rows_step - 1, [dict(zip(METRICS, map(float, r))) for r in rows])

    # -- iteration
    @property
    def sizes(self) -> np.ndarray:
        """Every worker's share of the next step."""
        return self.balancer.sizes

    def __len__(self) -> int:
        n = self.sampler.num_samples - self.sampler.offset(self.sampler.epoch)  # a new batch resumed mid-epoch
        b = self.sampler.global_batch
        return n // b if self.drop_last else -(-n // b)

    def _index_arrays(self):
        pos = self.sampler
        if pos.step >= len(self):  # the last epoch ran to its end: on to the next
            pos.epoch, pos.step = pos.epoch + 1, 0
        epoch, start = pos.epoch, pos.step
        order = self.sampler.order(epoch)
        gb, me, off = self.sampler.global_batch, self.group.rank, self.sampler.offset(epoch)
        for s in range(start, len(self)):
            if s > start:
                self._end()
                pos.step = s  # the step before is over
            batch = order[off + s * gb: off + (s + 1) * gb]
            plan = self.balancer.step_plan() if len(batch) == gb else self.balancer.plan_for(len(batch))
            self.micro = plan.micro if plan.strategy == "accumulate" else 0
            sizes, passes = plan.sizes, 0
            if self.claims is not None:  # the end of the batch is claimed while the step runs
                split = split_tail(plan.sizes, self.balancer.cfg.tail, self.balancer.cfg.tail_chunks, self.micro)
                self.claims.begin(split)
                sizes, passes = split.static, split.held  # an upper bound on the passes (micro_batches knows them)
            lo, hi, members = self._cut(sizes, me)
            mine = batch[lo: hi]
            shadow = self.balancer.shadow if len(batch) == gb else None
            self.copies = bool(shadow is not None and hi == lo and shadow[me] > 0)
            if self.copies:  # a probe: a step timed on copies, out of the exchange
                mine = batch[:int(shadow[me])]
            self._running, self._batch = s, batch
            self._begin(len(mine), len(batch), passes + (int(-(-len(mine) // self.micro)) if self.micro else 1),
                        members)
            yield mine
        self._end()
        pos.step = len(self)

    def _cut(self, sizes: np.ndarray, me: int) -> tuple[int, int, list[int]]:
        """Where worker `me`'s samples lie in a batch split by `sizes`, and the workers with
        samples; kept while the split stays the same array (a plan's, step after step)."""
        if self._cut_for is None or self._cut_for[0] is not sizes:
            bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self._cut_for = (sizes, (bounds[me], bounds[me + 1], np.flatnonzero(sizes > 0).tolist()))
        return self._cut_for[1]

    def __iter__(self):
        if self.claims is not None:
            raise UserError("tail= hands out samples while a step runs, which a DataLoader's batch_sampler cannot "
                            "take: use hetrain.BalancedLoader with tail=, or tail=0 here")
        self.balancer.require_every_worker("a DataLoader's batch_sampler must yield non-empty batches")
        for idx in self._index_arrays():
            n = len(self._batch)
            if n < self.group.size:  # the same on every worker: all stop here
                raise UserError(f"this epoch's last batch has {n} sample(s) for {self.group.size} workers, and a "
                                "DataLoader's batch_sampler cannot yield an empty batch: pass drop_last=True (or use "
                                "hetrain.BalancedLoader, whose workers can sit a step out)")
            yield idx.tolist()

    def claim(self) -> np.ndarray | None:
        """The next chunk of this step's tail (dataset indices), or None when it is used up."""
        got = self.claims.claim() if self.claims is not None else None
        return None if got is None else self._batch[got[0]: got[1]]

    def set_passes(self, passes: int) -> None:
        """Backward passes in this step (the exchange starts on the last one's hooks)."""
        if self.optimizer is not None and hasattr(self.optimizer, "backward_passes_per_step"):
            self.optimizer.backward_passes_per_step = max(1, passes)
