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
  to load the batch. On a GPU the step is timed by CUDA events on the device's stream
  (`hetrain.train.stepclock`), read once the device has finished it (a step later where
  it had not), so no step drains the device to be timed.
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

from typing import Literal, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ..errors import UserError
from ..perf.steptime import median_spread
from ..runtime.memory import engine_device_bytes, memory_limit
from ..runtime.memory import estimate_memory_per_sample
from .balance import BalanceConfig, Balancer
from .balanced_sampler import BalancedBatchSampler, WorkerGroup, _job_device

__all__ = ["BalancedLoader", "BalancedBatchSampler", "WorkerGroup"]


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
                     so shares are capped by the device's measured free memory; its
                     buffers go with the parameters to a worker that rejoins the
                     gradient exchange (`DistributedOptimizer.track_buffers`).
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
      tail           a fraction of every global batch (e.g. 0.2, default 0: off) handed out
                     while the step runs, in chunks, to whichever worker asks first
                     (`hetrain.train.tail`): workers whose speed varies from step to step
                     still finish together. Needs the `loader.micro_batches` loop.
      config         `BalanceConfig` (window, recent, every, min_samples, small_share, rejoin).
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
                 strategy: Literal["auto", "unequal", "accumulate"] | None = None, micro_batch: int | None = None,
                 tail: float | None = None):
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
                    codec = comm is not None and comm.coded
                    reserved_bytes += engine_device_bytes(sum(p.numel() for p in params), codec)
        self.batches = BalancedBatchSampler(len(dataset), global_batch, seed=seed, optimizer=optimizer,
                                            device=self.device, drop_last=drop_last, balance=balance, config=config,
                                            memory_per_sample=memory_per_sample, reserved_bytes=reserved_bytes,
                                            logger=logger, max_samples=max_samples, group=group, ctx=ctx,
                                            strategy=strategy, micro_batch=micro_batch, tail=tail)
        if model is not None and self.batches.leave:  # a worker that rejoins takes the batch-norm statistics too
            optimizer.track_buffers(model)
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
            # index_select, not t[index]: the same rows, without advanced indexing's
            # per-call setup (5 us against 25 us for two tensors of a 128-sample batch)
            out = tuple(t.index_select(0, index) for t in self._tensors)
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
        or its equal micro-batches (accumulate), then with `tail=` the chunks it claims
        from the end of the step. A loop written once runs every case:

            for x, y in loader:
                opt.zero_grad()
                for mx, my in loader.micro_batches(x, y):
                    (loss_fn(model(mx), my) * len(mx) / len(x)).backward()
                opt.step()

        (scaling each pass by its part of the local batch `x` keeps the gradient the local
        mean, which the optimizer weights by `len(x)`; the claimed chunks are scaled the
        same way, so their samples count as much as any). The next pass is known before
        this one runs (a chunk is claimed one pass ahead), so the optimizer starts the
        exchange on the last pass's backward. An empty share yields nothing: the worker
        sits the step out, out of its gradient exchange (hetrain.api.members; with
        `BalanceConfig(leave=False)` or `tail=`: in it, pushing zeros with weight 0)."""
        one = batch[0] if len(batch) == 1 else batch
        n = len(batch[0]) if batch else 0
        if n == 0:
            return
        passes = self._passes(one, len(batch), n, self.batches.micro)
        cur, k = next(passes), 0
        while cur is not None:
            nxt = next(passes, None)  # claims the next chunk before this pass runs
            self.batches.set_passes(k + 1 if nxt is None else k + 2)
            yield cur
            cur, k = nxt, k + 1

    def _passes(self, one, nargs: int, n: int, m: int):
        if not m or n <= m:
            yield one
        else:
            for lo in range(0, n, m):
                yield tree_map(lambda t: t[lo: lo + m] if isinstance(t, torch.Tensor) else t, one)
        while (idx := self.batches.claim()) is not None:
            got = self._fetch(idx, self.device)
            if isinstance(got, tuple):  # as many parts as the caller passed (x, or x and y, ...)
                got = got[0] if nargs == 1 else got[:nargs]
            yield got

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
    def copies(self) -> bool:
        """This worker's batch this step is a probe's: copies of samples other workers
        train on, timed while it sits out of the exchange, its gradients dropped (see
        BalancedBatchSampler.copies). A loop that counts what it trained on skips it."""
        return self.batches.copies

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
