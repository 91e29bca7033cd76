"""Balanced data in one object: this worker's share of every global batch, on its device,
with the worker's speed measured and the shares re-balanced as training goes.

    loader = hetrain.BalancedLoader(dataset, global_batch=256, optimizer=opt, model=model)
    for epoch in range(epochs):
        for x, y in loader:                  # this worker's share, collated, on its device
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()                       # the loader has set the batch size for push_pull

What it does each step:

- Cuts the epoch's global batch by the current shares (`GlobalBatchSampler`): every
  sample of an epoch is seen exactly once by exactly one worker, whatever the shares,
  and every worker runs the same number of steps.
- Measures this worker's compute for the step: from handing out the batch to the end of
  `optimizer.step()` (a step post-hook on the wrapped optimizer; without an optimizer,
  to the next request), minus the time the engine spent exchanging (its `comm_s` +
  `wait_s`, i.e. waiting for the other workers and for the sums), plus the time it took
  to load the batch. On a GPU the device is synchronised before the clock is read.
- Exchanges the step-time fits and the step's metrics in one all-gather and solves the
  next shares (`hetrain.train.balance`): all workers are predicted to finish together.
  The all-gather runs in the background during the next step (`overlap_exchange`), so
  no worker waits for the others here; the shares use fits one step older.

`BalancedBatchSampler` is the same thing for users with their own `DataLoader`
(`DataLoader(ds, batch_sampler=BalancedBatchSampler(...))`): it yields this worker's
index lists. With `num_workers > 0` the DataLoader asks for indices ahead of time, so
shares follow speed `num_workers · prefetch_factor` steps late; timing stays right in
steady state because one index list is asked for per batch consumed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ..errors import UserError
from ..perf.steptime import median_spread, spread
from ..runtime.memory import engine_device_bytes, memory_limit, synchronize
from .balance import (BalanceConfig, Balancer, Gather, estimate_memory_per_sample,
                      worker_gather)
from .sampler import GlobalBatchSampler

__all__ = ["BalancedLoader", "BalancedBatchSampler", "WorkerGroup"]

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


def _job_group(ctx) -> WorkerGroup:
    labels = tuple(ctx.topology.worker_labels) if ctx.topology else ("w0",)
    return WorkerGroup(ctx.rank if ctx.distributed else 0, ctx.num_workers, worker_gather(ctx, "exchanging step "
                                                                                           "times"), labels)


def _job_device(ctx) -> torch.device:
    """This worker's device (`hetrain.device()`: cuda:<local rank> on a machine with
    `cuda: true`, else the CPU)."""
    return getattr(ctx, "device", None) or torch.device("cpu")


def _zero_stats() -> tuple[float, float, float, float]:
    return 0.0, 0.0, 0.0, 0.0


class BalancedBatchSampler(torch.utils.data.Sampler):
    """This worker's indices for every step of an epoch, balanced by measured speed.

    Arguments as for `BalancedLoader` (without the loading ones); `num_samples` is the
    dataset's length. Iterating gives lists of indices; `len()` is the number of steps.
    """

    def __init__(self, num_samples: int, global_batch: int, *, seed: int = 0, optimizer=None,
                 device: torch.device | None = None, drop_last: bool = False,
                 balance: Literal["measured", "equal"] = "measured", config: BalanceConfig | None = None,
                 memory_per_sample: float = 0.0, reserved_bytes: float = 0.0, logger=None,
                 max_samples: Sequence[int] | None = None, group: WorkerGroup | None = None, ctx=None,
                 strategy: Literal["auto", "unequal", "accumulate"] | None = None, micro_batch: int | None = None):
        if num_samples < 1:
            raise UserError(f"the dataset is empty (0 samples); BalancedLoader needs at least {global_batch}")
        if global_batch < 1:
            raise UserError(f"global_batch must be >= 1 sample, got {global_batch}")
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
        lockstep = ctx is None or not ctx.distributed or ctx.comm.sync == "sync"
        base = config or BalanceConfig()
        cfg = BalanceConfig(**{**base.__dict__, "policy": balance if lockstep else "equal",
                               "memory_per_sample": memory_per_sample or base.memory_per_sample,
                               "reserved_bytes": reserved_bytes or base.reserved_bytes,
                               "strategy": strategy or base.strategy,
                               "micro_batch": base.micro_batch if micro_batch is None else micro_batch})
        self.balancer = Balancer(ctx, global_batch, cfg, device=self.device, gather=group.gather, caps=max_samples,
                                 num_workers=group.size, labels=list(group.labels) or None, lockstep=lockstep)
        self.optimizer = optimizer
        self.engine = getattr(optimizer, "engine", None)
        self.logger = logger
        self._running = 0  # the step handed out last (its index in the epoch)
        self.micro = 0  # this worker's micro-batch in the step handed out last (0: one pass)
        self.spreads: list[float] = []  # measured compute spread (max/min over workers) per step
        self.last_rows: np.ndarray | None = None
        self.exchange_s = 0.0  # time spent in the per-step exchange (waiting for the others included)
        self._open: tuple | None = None  # (samples, t_out, stats at t_out) of the step handed out
        self._hook_end: tuple | None = None
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

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def _on_step(self, *_args) -> None:
        if self._open is not None and self._hook_end is None:
            self._hook_end = (self._now(), self._stats())
            self.sampler.step = self._running + 1  # the update is applied: a commit from here resumes after it

    def _begin(self, samples: int, total: int | None = None, passes: int = 1) -> None:
        self._ensure_hook()
        if self.engine is not None and hasattr(self.engine, "while_waiting"):
            self.engine.while_waiting(self.balancer.prefetch)  # re-plan while the step's exchange waits
        if self.optimizer is not None and hasattr(self.optimizer, "set_batch_size"):
            self.optimizer.set_batch_size(samples, total=total)
        if self.optimizer is not None and hasattr(self.optimizer, "backward_passes_per_step"):
            # accumulating: the exchange starts on this worker's last micro-batch
            self.optimizer.backward_passes_per_step = max(1, passes)
        self._hook_end = None
        self._open = (samples, time.perf_counter(), self._stats())

    def _end(self) -> None:
        """Close the step handed out last: measure it, exchange, re-balance, log."""
        if self._open is None:
            return
        samples, t_out, s0 = self._open
        end, s1 = self._hook_end if self._hook_end is not None else (self._now(), self._stats())
        self._open = self._hook_end = None
        comm, wait, hidden, nbytes = (b - a for a, b in zip(s0, s1))
        compute = max(0.0, end - t_out - comm - wait)
        self.balancer.record(samples, compute)
        t0 = time.perf_counter()
        self.balancer.update(extra=(samples, compute, comm, wait, hidden, nbytes))
        self.exchange_s += time.perf_counter() - t0
        self._log()

    def finish(self) -> None:
        """End of training (every worker, same point): close the step handed out last if
        the loop was left early, and complete the exchange still in flight, so the last
        step is measured, logged and counted. A collective."""
        self._end()
        t0 = time.perf_counter()
        self.balancer.flush()
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

    # -- position in the data (committed by an elastic job)
    @property
    def epoch(self) -> int:
        """The epoch the position is in."""
        return self.sampler.epoch

    @property
    def step(self) -> int:
        """Steps of `epoch` done: their updates applied (the wrapped optimizer's step
        returned) or the next step asked for. `len(self)`: the epoch is over."""
        return self.sampler.step

    def state_dict(self) -> dict:
        """The position (epoch, step) and what fixes the data order (seed, sizes). Shares
        are not kept: a restored job measures its own workers afresh."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position `state_dict` gave: the next iteration yields the
        remaining steps of its epoch, cut by the shares of this run's workers (the
        global batches depend on (seed, epoch, step) only, so every remaining sample of
        the epoch is still seen exactly once, whatever the number of workers)."""
        self.sampler.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        """The next iteration runs this epoch from its start (default: the epoch after
        the last, or the rest of a restored one; setting the restored epoch keeps its
        position)."""
        pos = self.sampler
        if int(epoch) != pos.epoch or pos.step >= len(self):
            pos.epoch, pos.step = int(epoch), 0

    def epochs(self, num_epochs: int):
        """Epoch numbers from the position on, below `num_epochs`:
        `for epoch in loader.epochs(N): for x, y in loader: ...` runs the epochs left
        (after a restore, the rest of the committed one first)."""
        pos = self.sampler
        while True:
            if pos.step >= len(self):
                pos.epoch, pos.step = pos.epoch + 1, 0
            if pos.epoch >= num_epochs:
                return
            epoch = pos.epoch
            yield epoch
            if pos.epoch == epoch and pos.step < len(self):  # the loop left the epoch early: on to the next
                pos.epoch, pos.step = epoch + 1, 0

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
            plan = self.balancer.plan if len(batch) == gb else self.balancer.plan_for(len(batch))
            bounds = np.concatenate([[0], np.cumsum(plan.sizes)])
            mine = batch[bounds[me]: bounds[me + 1]]
            self._running = s
            self.micro = plan.micro if plan.strategy == "accumulate" else 0
            self._begin(len(mine), int(bounds[-1]), int(-(-len(mine) // self.micro)) if self.micro else 1)
            yield mine
        self._end()
        pos.step = len(self)

    def __iter__(self):
        for idx in self._index_arrays():
            yield idx.tolist()


class BalancedLoader:
    """This worker's share of each global batch of `dataset`, collated, on its device.

    Arguments:
      dataset        a map-style dataset (`ds[i]`, `len(ds)`); a `TensorDataset` (or a
                     tuple of equal-length tensors) is indexed in one go, without a
                     per-sample Python loop.
      global_batch   samples per step over all workers (fixed; the shares change).
      optimizer      the `hetrain.DistributedOptimizer`: the loader sets its batch size
                     each step and takes the step's end and the exchange time from it.
      model          used to estimate the memory one sample needs (forward hooks) and
                     the model state (parameters, gradients and one optimizer buffer),
                     so shares are capped by the device's measured free memory.
      memory_per_sample, reserved_bytes   give these instead (bytes).
      device         where batches go (default: `hetrain.device()`, this worker's GPU when
                     its machine says `cuda: true` in the cluster file, else the CPU).
      preload        copy a TensorDataset to the device once (default: on a GPU, when it
                     takes at most a quarter of the free memory).
      balance        "measured" (default) or "equal" (fixed equal shares, still measured).
      strategy       "unequal" (one local batch per worker, sizes by speed), "accumulate"
                     (equal micro-batches of `micro_batch` samples, a count per worker:
                     gradient accumulation, every forward sees the same batch size), or
                     "auto" (default): the one the step-time model predicts faster; loop
                     over `loader.micro_batches(x, y)` to run either.
      config         `BalanceConfig` (window, recent, every, min_samples).
      max_samples    optional per-worker limits on top of memory (0: the worker sits out).
      logger         a `hetrain.train.metrics.StepLogger`: per-step shares, times, bytes
                     and the compute-time spread go to TensorBoard and steps.jsonl.
      seed, drop_last, collate_fn   as for a DataLoader (the epoch's order is seeded by
                     (seed, epoch), the same on every worker).

    Every worker must iterate the loader the same number of times (it exchanges a small
    row with the other workers at every step).
    """

    def __init__(self, dataset, global_batch: int, *, optimizer=None, model: torch.nn.Module | None = None,
                 memory_per_sample: float | None = None, reserved_bytes: float | None = None,
                 device: torch.device | str | None = None, preload: bool | None = None,
                 balance: Literal["measured", "equal"] = "measured", config: BalanceConfig | None = None,
                 logger=None, seed: int = 0, drop_last: bool = False, collate_fn=None,
                 max_samples: Sequence[int] | None = None, group: WorkerGroup | None = None, ctx=None,
                 strategy: Literal["auto", "unequal", "accumulate"] | None = None, micro_batch: int | None = None):
        if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
            dataset = torch.utils.data.TensorDataset(*dataset)
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise UserError(f"BalancedLoader needs a map-style dataset (len(ds) and ds[i]); got {type(dataset).__name__}")
        self.dataset = dataset
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        if device is None:
            if ctx is None and group is None:
                from ..runtime.context import init
                ctx = init()
            device = _job_device(ctx)
        self.device = torch.device(device)
        self._tensors = list(dataset.tensors) if isinstance(dataset, torch.utils.data.TensorDataset) else None
        if memory_per_sample is None:
            memory_per_sample = 0.0
            if model is not None:
                model_dev = next((p.device for p in model.parameters()), torch.device("cpu"))
                example = self._fetch(np.arange(1), model_dev)
                example = example[0] if isinstance(example, (tuple, list)) else example
                try:
                    memory_per_sample = estimate_memory_per_sample(model, example)
                except Exception as err:  # the sample's first element is not the model's input
                    raise UserError(f"BalancedLoader could not run the model on the dataset's first sample to "
                                    f"measure its memory ({type(err).__name__}: {err}); pass "
                                    "memory_per_sample=BYTES instead of model=") from None
        if reserved_bytes is None:
            reserved_bytes = 0.0
            if model is not None:
                params = [p for p in model.parameters()]
                pbytes = float(sum(p.numel() * p.element_size() for p in params))
                on_device = bool(params) and params[0].device == self.device
                # gradients + one optimizer buffer (SGD momentum); the parameters too unless
                # they already sit on the device (then its free memory already excludes them)
                reserved_bytes = pbytes * (2.0 if on_device else 3.0)
                if self.device.type == "cuda":  # and hetrain's own GPU buffers for push_pull
                    comm = getattr(ctx, "comm", None)
                    codec = comm is not None and (comm.codec != "fp32" or bool(comm.codec_rules))
                    reserved_bytes += engine_device_bytes(sum(p.numel() for p in params), codec)
        self.batches = BalancedBatchSampler(len(dataset), global_batch, seed=seed, optimizer=optimizer,
                                            device=self.device, drop_last=drop_last, balance=balance, config=config,
                                            memory_per_sample=memory_per_sample, reserved_bytes=reserved_bytes,
                                            logger=logger, max_samples=max_samples, group=group, ctx=ctx,
                                            strategy=strategy, micro_batch=micro_batch)
        if self._tensors is not None and self.device.type != "cpu":
            size = sum(t.numel() * t.element_size() for t in self._tensors)
            if preload is None:
                preload = size <= 0.25 * memory_limit(self.device).bytes
            if preload:
                self._tensors = [t.to(self.device) for t in self._tensors]

    # -- loading
    def _fetch(self, idx: np.ndarray, device: torch.device):
        if self._tensors is not None:
            index = torch.as_tensor(idx, dtype=torch.long, device=self._tensors[0].device)
            out = tuple(t[index] for t in self._tensors)
        elif len(idx) == 0:  # an empty share (an epoch's last batch smaller than the workers)
            out = tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t,
                           self.collate_fn([self.dataset[0]]))
        elif hasattr(self.dataset, "__getitems__"):
            out = self.collate_fn(self.dataset.__getitems__(idx.tolist()))
        else:
            out = self.collate_fn([self.dataset[int(i)] for i in idx])
        if isinstance(out, tuple) and all(isinstance(t, torch.Tensor) and t.device == device for t in out):
            return out  # indexed where it is used (a TensorDataset on the device): nothing to move
        non_blocking = device.type == "cuda"
        return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, out)

    def __iter__(self):
        for idx in self.batches._index_arrays():
            yield self._fetch(idx, self.device)

    def micro_batches(self, *batch):
        """The passes of this worker's current batch: the batch itself (strategy unequal),
        or its equal micro-batches (accumulate). A loop written once runs both:

            for x, y in loader:
                opt.zero_grad()
                for mx, my in loader.micro_batches(x, y):
                    (loss_fn(model(mx), my) * len(mx) / len(x)).backward()
                opt.step()

        (scaling each pass by its part of the local batch keeps the gradient the local
        mean, which the optimizer weights by the local batch size). An empty share yields
        nothing: the worker sits the step out and pushes zeros with weight 0."""
        one = batch[0] if len(batch) == 1 else batch
        n = len(batch[0]) if batch else 0
        m = self.batches.micro
        if n == 0:
            return
        if not m or n <= m:
            yield one
            return
        for lo in range(0, n, m):
            yield tree_map(lambda t: t[lo: lo + m] if isinstance(t, torch.Tensor) else t, one)

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    # -- position (see BalancedBatchSampler): hetrain.elastic.State(loader=loader) commits it
    @property
    def epoch(self) -> int:
        return self.batches.epoch

    @property
    def step(self) -> int:
        return self.batches.step

    def epochs(self, num_epochs: int):
        return self.batches.epochs(num_epochs)

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)

    def finish(self) -> None:
        """See `BalancedBatchSampler.finish`: call on every worker after the last step."""
        self.batches.finish()

    # -- what the balancer knows
    @property
    def sizes(self) -> np.ndarray:
        return self.batches.sizes

    @property
    def balancer(self) -> Balancer:
        return self.batches.balancer

    @property
    def spreads(self) -> list[float]:
        return self.batches.spreads

    def spread_median(self, skip: int | None = None) -> float:
        """Median measured compute spread (max/min over workers) after the first steps
        (default: skip the first `window` steps, while the fits settle)."""
        return median_spread(self.batches.spreads, self.balancer.cfg.window if skip is None else skip)
