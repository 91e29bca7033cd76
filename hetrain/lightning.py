"""hetrain under Lightning's `Trainer`: per-device batch shares set by measured speed and
memory, gradients exchanged by hetrain's engine (summation servers, codecs, overlap),
processes started by `hetrain launch`.

    import lightning as L
    from hetrain.lightning import HetrainStrategy

    trainer = L.Trainer(strategy=HetrainStrategy(), max_epochs=10)   # or strategy="hetrain"
    trainer.fit(model, datamodule=dm)

    $ hetrain launch --cluster examples/clusters/one_machine.yaml train.py

The strategy joins the job the launcher started (`hetrain.init()`): Lightning sees the
job's workers as its world (summation servers are not counted), each on its own device
(`hetrain.device()`: its GPU where the cluster file says `cuda: true`, else the CPU).

Data: the training `DataLoader` is rebuilt around `hetrain.BalancedBatchSampler`, so each
worker gets its share of every global batch (the rule, since Lightning itself would give
every worker an equal `DistributedSampler` slice). The global batch is the DataLoader's
`batch_size` times the number of workers (what DDP trains on with that `batch_size`), or
`HetrainStrategy(global_batch=N)`. Its dataset, `collate_fn`, `num_workers`, `pin_memory`
and `drop_last` are kept; its `shuffle`/`sampler` are replaced by hetrain's order, seeded
by `(seed, epoch)` and the same on every worker, so each sample of an epoch is trained on
once by one worker whatever the shares. Validation, test and predict loaders keep
Lightning's equal `DistributedSampler` over the workers.

Optimizers are wrapped in `hetrain.DistributedOptimizer` (a batch-weighted average of the
workers' gradients, so unequal shares give the update of one process on the global
batch). Gradients are exchanged right after backward, before Lightning clips them, as
`optimizer.synchronize()` then `skip_synchronize()` do in a hand-written loop.
Lightning's collectives (`self.log(..., sync_dist=True)`, `all_gather`, checkpoint
decisions, barriers) run among the workers through hetrain's API; `broadcast` carries
what `hetrain.broadcast_object` may (no pickle). `strategy="hetrain"` is registered in
Lightning's strategy registry when this module is imported.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Literal

import torch
from torch import Tensor

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
except ImportError as err:  # an optional extra
    raise ImportError(f"hetrain.lightning needs Lightning ({err}); install it with "
                      "`pip install 'hetrain[lightning]'` (or `pip install lightning`)") from None

import hetrain
from .errors import UserError
from .runtime.memory import engine_device_bytes, estimate_memory_per_sample

__all__ = ["HetrainEnvironment", "HetrainStrategy"]

log = logging.getLogger(__name__)

# Lightning's reduce ops (strings or torch.distributed.ReduceOp) -> hetrain's
_OPS = {"sum": "Sum", "max": "Max", "min": "Min", "mean": "Average", "avg": "Average", "product": "Product"}


class HetrainEnvironment(ClusterEnvironment):
    """Who is who, as the hetrain launcher told this process: Lightning's world is the
    job's workers (summation servers are not counted). The launcher started every
    process, so Lightning starts none."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        env = hetrain.init().env
        return env.master_addr if env else "127.0.0.1"

    @property
    def main_port(self) -> int:
        env = hetrain.init().env
        return env.master_port if env else 0

    @staticmethod
    def detect() -> bool:
        return "HETRAIN_RANK" in os.environ

    def world_size(self) -> int:
        return hetrain.size()

    def set_world_size(self, size: int) -> None:
        if size != hetrain.size():
            log.debug("Lightning asked for world size %d; the hetrain job has %d workers", size, hetrain.size())

    def global_rank(self) -> int:
        return hetrain.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != hetrain.rank():
            log.debug("Lightning asked for global rank %d; this hetrain worker is %d", rank, hetrain.rank())

    def local_rank(self) -> int:
        return hetrain.local_rank()

    def node_rank(self) -> int:
        return hetrain.cross_rank()


class _LightningBatchSampler(hetrain.BalancedBatchSampler):
    """`BalancedBatchSampler` as a Lightning `DataLoader`'s batch sampler. Two differences
    from a hand-written loop: Lightning does not ask for more after an epoch's last batch
    (it knows the length), so the step handed out last is closed when the next epoch
    starts (every worker at the same point); and a `DataLoader` with `num_workers > 0`
    asks for index lists ahead of time, so each list's (share, global batch) is queued
    and the strategy tells the optimizer the one of the batch actually trained."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed: deque[tuple[int, int]] = deque()

    def __iter__(self):
        self._end()  # the last epoch's last step (a collective: every worker is here)
        self.handed.clear()  # lists handed ahead to a loader that was left early
        for idx in super().__iter__():
            self.handed.append((len(idx), len(self._batch)))
            yield idx


class HetrainStrategy(ParallelStrategy):
    """Lightning strategy: hetrain's balanced shares, exchange and launcher.

    Arguments:
      global_batch       samples per step over all workers (default: the training
                         DataLoader's batch_size x the number of workers).
      balance            "measured" (default: shares follow measured speed and memory) or
                         "equal".
      memory_per_sample  bytes one sample needs on the device (activations and their
                         gradients); default: measured with the model on the dataset's
                         first sample (forward hooks), else no memory cap.
      max_samples        per-worker caps on top of memory (0: the worker sits out).
      seed               seeds the data order (default: Lightning's PL_GLOBAL_SEED, else 0).
      overlap            push gradients during backward (default: the job's --overlap;
                         always in mode allreduce).
      config             `hetrain.train.balance.BalanceConfig` (window, recent, every, ...).
    """

    strategy_name = "hetrain"

    def __init__(self, global_batch: int | None = None, *, balance: Literal["measured", "equal"] = "measured",
                 memory_per_sample: float | None = None, max_samples: list[int] | None = None,
                 seed: int | None = None, overlap: bool | None = None, config=None,
                 accelerator: "pl.accelerators.Accelerator | None" = None, checkpoint_io=None, precision_plugin=None):
        if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                         or global_batch < 1):
            raise UserError(f"HetrainStrategy(global_batch={global_batch!r}): write a whole number of samples per "
                            "step over all workers, e.g. global_batch=256 (or leave it out: the training DataLoader's "
                            "batch_size x the number of workers)")
        if balance not in ("measured", "equal"):
            raise UserError(f"HetrainStrategy(balance={balance!r}): write balance='measured' or balance='equal'")
        self.ctx = hetrain.init()  # the job the launcher started (a plain `python` run: one worker)
        super().__init__(accelerator=accelerator, parallel_devices=[hetrain.device()],
                         cluster_environment=HetrainEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.global_batch = global_batch
        self.balance = balance
        self.memory_per_sample = memory_per_sample
        self.max_samples = max_samples
        self.seed = seed
        self.overlap = overlap
        self.config = config
        self.batch_sampler: _LightningBatchSampler | None = None  # the training loader's, once made

    # -- who and where
    @property
    def root_device(self) -> torch.device:
        return hetrain.device()

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this (accelerator connector); True also makes
        # it put a DistributedSampler on evaluation loaders over `distributed_sampler_kwargs`
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hetrain.size(), "rank": hetrain.rank()}

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu" and not isinstance(self.accelerator, CPUAccelerator):
            # a CPU worker of a job whose other workers are GPUs, under Trainer(accelerator="auto")
            # on a CUDA host (or strategy="hetrain", which Lightning builds before any device
            # is known): this process trains on the CPU
            self.accelerator = CPUAccelerator()
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- model and optimizers
    def setup(self, trainer: "pl.Trainer") -> None:
        if self._layer_sync is not None:
            raise UserError("Trainer(sync_batchnorm=True) converts to torch's SyncBatchNorm, whose collectives would "
                            "include hetrain's summation servers: convert the model's BatchNorm layers to "
                            "hetrain.SyncBatchNorm yourself and leave sync_batchnorm off")
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            raise UserError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with HetrainStrategy: "
                            "each step's batch is already cut into unequal shares by speed; raise the global batch "
                            "(HetrainStrategy(global_batch=N)) instead of accumulating")
        _signals_on_workers(trainer)
        super().setup(trainer)  # moves the model, makes the optimizers (setup_optimizers below)
        assert self.model is not None
        # every worker starts from rank 0's weights (a resumed run: every rank loaded the same checkpoint)
        hetrain.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        named = list(self.lightning_module.named_parameters())
        wrapped = []
        for opt in self.optimizers:
            mine = {id(p) for group in opt.param_groups for p in group["params"]}
            wrapped.append(hetrain.DistributedOptimizer(
                opt, named_parameters=[(n, p) for n, p in named if id(p) in mine], overlap=self.overlap))
        self.optimizers = wrapped  # the schedulers keep the wrapped optimizers: they share param_groups

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """Exchange the gradients right after backward (at the end of the closure that runs
        training_step and backward), so what Lightning does between backward and the
        update (gradient clipping, on_before_optimizer_step) sees the averaged gradients;
        the optimizer's step then runs the update without a second exchange."""
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's own
        if not isinstance(inner, hetrain.DistributedOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def exchanged():
            result = closure()
            inner.synchronize()
            return result

        return super().optimizer_step(optimizer, exchanged, model, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Tell the optimizers this worker's batch size (the weight of its gradients),
        from the batch about to be trained, before its backward starts the exchange."""
        n = extract_batch_size(batch)
        total = None
        if self.batch_sampler is not None and self.batch_sampler.handed:
            share, whole = self.batch_sampler.handed.popleft()
            total = whole if share == n else None  # a batch the sampler did not cut: no total known
        for opt in self.optimizers:
            if isinstance(opt, hetrain.DistributedOptimizer):
                opt.set_batch_size(n, total=total)

    def on_train_end(self) -> None:
        if self.batch_sampler is not None:
            self.batch_sampler.finish()  # the last step's measurement and exchange (every worker)

    # -- data
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (trainer is None or trainer.state.stage != RunningStage.TRAINING
                or not isinstance(dataloader, torch.utils.data.DataLoader)):
            return dataloader
        if isinstance(dataloader.batch_sampler, hetrain.BalancedBatchSampler):
            return dataloader  # the user's own balanced sampler
        return self._balanced(dataloader)

    def _balanced(self, dl: torch.utils.data.DataLoader) -> torch.utils.data.DataLoader:
        """The training loader rebuilt around hetrain's balanced batch sampler."""
        dataset = dl.dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise UserError("HetrainStrategy cuts each global batch into per-worker shares by index, which needs a "
                            "map-style training dataset (len(ds) and ds[i]); this one is iterable")
        per_device = dl.batch_size if dl.batch_size is not None else getattr(dl.batch_sampler, "batch_size", None)
        global_batch = self.global_batch or (per_device or 0) * hetrain.size()
        if global_batch < 1:
            raise UserError("HetrainStrategy: the training DataLoader has no batch_size; pass "
                            "HetrainStrategy(global_batch=N)")
        drop_last = bool(getattr(dl.batch_sampler, "drop_last", False))
        if self.batch_sampler is None or self.batch_sampler.sampler.num_samples != len(dataset):
            if self.batch_sampler is not None:
                self.batch_sampler.finish()
            self.batch_sampler = _LightningBatchSampler(
                len(dataset), global_batch, seed=self._seed(), optimizer=self._first_optimizer(),
                device=self.root_device, drop_last=drop_last, balance=self.balance, config=self.config,
                memory_per_sample=self._memory_per_sample(dataset, dl.collate_fn),
                reserved_bytes=self._reserved_bytes(), max_samples=self.max_samples, strategy="unequal")
        workers = dl.num_workers
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=self.batch_sampler, num_workers=workers, collate_fn=dl.collate_fn,
            pin_memory=dl.pin_memory, timeout=dl.timeout, worker_init_fn=dl.worker_init_fn,
            multiprocessing_context=dl.multiprocessing_context if workers else None, generator=dl.generator,
            prefetch_factor=dl.prefetch_factor if workers else None,
            persistent_workers=dl.persistent_workers if workers else False, pin_memory_device=dl.pin_memory_device)

    def _seed(self) -> int:
        return self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _first_optimizer(self):
        opts = [o for o in self.optimizers if isinstance(o, hetrain.DistributedOptimizer)]
        if len(opts) > 1:
            rank_zero_warn("HetrainStrategy: several optimizers; the first one's steps end each measured step")
        return opts[0] if opts else None

    def _memory_per_sample(self, dataset, collate_fn) -> float:
        if self.memory_per_sample is not None:
            return float(self.memory_per_sample)
        example = collate_fn([dataset[0]])
        example = example[0] if isinstance(example, (tuple, list)) else example
        if isinstance(example, Tensor):
            example = example.to(self.root_device)
        try:
            return estimate_memory_per_sample(self.lightning_module, example)
        except Exception as err:  # the model's forward takes something else than the sample's first part
            rank_zero_warn(f"HetrainStrategy could not run the model on the training set's first sample to measure "
                           f"its memory ({type(err).__name__}: {err}); shares are not capped by memory. Pass "
                           "HetrainStrategy(memory_per_sample=BYTES) to cap them")
            return 0.0

    def _reserved_bytes(self) -> float:
        """The model's state on the device: gradients and one optimizer buffer (the
        parameters themselves are already there, so the free memory excludes them), and
        on a GPU hetrain's own exchange buffers."""
        params = list(self.lightning_module.parameters())
        numel = sum(p.numel() for p in params)
        reserved = 2.0 * float(sum(p.numel() * p.element_size() for p in params))
        if self.root_device.type == "cuda":
            comm = self.ctx.comm
            reserved += engine_device_bytes(numel, comm.coded)
        return reserved

    # -- collectives among the workers
    # Each one waits for the slowest worker; that time is counted as waiting, never as
    # this worker's compute (the balancer reads compute as speed), so a
    # `self.log(..., sync_dist=True)` in training_step does not hide the workers' speeds.
    def reduce(self, tensor, group: Any | None = None, reduce_op: Any = "mean"):
        if not isinstance(tensor, Tensor):
            return tensor
        _no_group(group, "reduce")
        name = _op_name(reduce_op)
        with _waiting():
            if name == "Average" and not tensor.is_floating_point():  # Lightning's mean of an int is a float
                return hetrain.allreduce(tensor.double(), op=hetrain.Sum) / hetrain.size()
            return hetrain.allreduce(tensor, op=getattr(hetrain, name))

    def barrier(self, name: str | None = None) -> None:
        with _waiting():
            hetrain.barrier()

    def broadcast(self, obj, src: int = 0):
        with _waiting():
            return hetrain.broadcast_object(obj, root_rank=src)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        _no_group(group, "all_gather")
        with _waiting():
            if sync_grads:
                return _Gather.apply(tensor)
            return hetrain.allgather(tensor.unsqueeze(0))

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="hetrain: batch shares by measured speed, hetrain's exchange and "
                                               "launcher (hetrain launch)")


def _signals_on_workers(trainer: "pl.Trainer") -> None:
    """Lightning tells rank 0's SIGTERM to the other ranks by a broadcast on the default
    process group, at every training step and in its signal handler. A hetrain job's
    default group also holds the summation servers, which never join that broadcast, so it
    would hang. hetrain's launcher signals every process of the job itself, so each worker
    acts on its own SIGTERM (Lightning then stops at the end of the batch, as it does for a
    SIGTERM on any rank), and the step keeps free of that extra collective."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "_sigterm_notifier_fn"):
        def notified(signum, _frame) -> None:
            log.info("[rank %d] received SIGTERM (%s)", hetrain.rank(), signum)
            connector.received_sigterm = True

        connector._sigterm_notifier_fn = notified  # registered after strategy.setup (Trainer._run)
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


class _Gather(torch.autograd.Function):
    """all_gather(sync_grads=True): each worker's tensor stacked; the gradient of its own
    row is the sum of every worker's gradient for that row."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:
        return hetrain.allgather(tensor.detach().unsqueeze(0))

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return hetrain.allreduce(grad.contiguous(), op=hetrain.Sum)[hetrain.rank()]


def _op_name(reduce_op) -> str:
    key = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    key = {"AVG": "mean", "PRODUCT": "product"}.get(str(key).upper(), str(key)).lower()
    if key not in _OPS:
        raise UserError(f"HetrainStrategy.reduce(reduce_op={reduce_op!r}): use one of 'mean', 'sum', 'max', 'min', "
                        "'product'")
    return _OPS[key]


@contextmanager
def _waiting():
    """Count the time inside as waiting for the other workers (the engine's `wait_s`,
    which the balanced sampler subtracts from the step's compute)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats = getattr(hetrain.engine(), "stats", None)
        if stats is not None:
            stats.wait_s += time.perf_counter() - t0


def _no_group(group, what: str) -> None:
    if group is not None:
        raise UserError(f"HetrainStrategy.{what}(group=...): hetrain's collectives run among all the job's workers; "
                        "leave group out")


if HetrainStrategy.strategy_name not in StrategyRegistry:  # Trainer(strategy="hetrain")
    HetrainStrategy.register_strategies(StrategyRegistry)
