"""Horovod Elastic's names on hetrain's elastic machinery (hetrain/train/elastic.py).

Horovod keeps the processes alive and resets them in place when hosts change; hetrain
restarts them (as torchrun does): a new round of the job starts every worker from the
newest commit. What Horovod scripts do maps as follows:

- `TorchState(model, optimizer, epoch=0, batch=0, ...)`: a `State` holding the model,
  the optimizer and the keyword extras (samplers, numbers); `state.commit()` as in
  Horovod; `state.check_host_updates()` honours a pending resize at once.
- `register_reset_callbacks([fn, ...])`: Horovod calls them after a reset with the new
  world; hetrain calls them at the start of every round after the first (the restarted
  job, possibly on a different number of workers), after the state is restored, before
  the training function runs: e.g. to scale the learning rate by `hetrain.size()`.
- `HostsUpdatedInterrupt`: raised by a script (or by Horovod's machinery) to leave the
  training function at a commit boundary; `run` turns it into a resize of the job: the
  state is committed, every worker exits with EXIT_RESIZE, and the launcher starts the
  next round (which picks up machines that joined).
- `ElasticSampler(dataset, shuffle=True, seed=0)`: this worker's share of the indices
  not yet processed in the epoch, re-sharded over the workers of each round;
  `record_batch(batch_idx, batch_size)` marks a batch done (the state_dict keeps them).
"""
from __future__ import annotations

import functools
import math

import torch
from torch.utils.data import Sampler

from ..errors import UserError
from ..train import elastic as _elastic
from .basics import rank, size

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "TorchState", "ElasticSampler", "run"]


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: leave the training function and restart the job on the
    new hosts from the last commit (Horovod's meaning; `skip_sync` is accepted)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class ObjectState(_elastic.State):
    """Horovod's `ObjectState(**kwargs)`: plain values (numbers, strings, lists and dicts
    of them) and objects with state_dict()/load_state_dict(), each an attribute."""

    _own = _elastic.State._own + ("_reset_callbacks",)

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "_reset_callbacks", [])

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called with no arguments at the start of every restarted round."""
        for cb in callbacks:
            if not callable(cb):
                raise UserError(f"register_reset_callbacks: {cb!r} is not callable")
            self._reset_callbacks.append(cb)

    def on_reset(self) -> None:
        for cb in self._reset_callbacks:
            cb()

    def check_host_updates(self) -> None:
        """Honour a pending resize or stop request now (commits first)."""
        self.check()

    def save(self) -> None:
        """Horovod's in-memory save: here a commit (in memory and on disk)."""
        self.commit()


class TorchState(ObjectState):
    """Horovod's `TorchState(model, optimizer, **kwargs)`: model and optimizer
    (positional or by keyword) and the keyword extras."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        items = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(**items, **kwargs)


def run(func):
    """Decorate the training function `func(state, ...)` as Horovod's `hvd.elastic.run`:
    restore the newest commit, call the reset callbacks in a restarted round, and leave
    the job in order at an agreed stop or a HostsUpdatedInterrupt."""

    @functools.wraps(func)
    def body(state, *args, **kwargs):
        if state.round > 0 and isinstance(state, ObjectState):
            state.on_reset()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            state.commit()  # every worker: the next round resumes from here
            raise _elastic.StopAtCommit(_elastic.EXIT_RESIZE, f"hosts updated: stopped at commit {state.commits} "
                                        "so that the job restarts on the new hosts") from None

    return _elastic.run(body)


class ElasticSampler(Sampler):
    """Horovod's `ElasticSampler`: shuffles the dataset per epoch (seed + epoch), skips
    the indices already processed this epoch (`record_batch`/`record_indices`), and
    gives this worker every size()-th of the rest. Its state_dict keeps the epoch and
    the processed indices, so a restored round goes on where the commit was."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: nothing of it processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch `batch_idx` (of `batch_size` samples) of every worker's share is done.
        The workers step together and the shards are a fixed function of the epoch, so
        each worker records all workers' batch without communicating, and any worker's
        commit holds the whole job's progress."""
        lo = batch_idx * batch_size
        for r in range(self.num_replicas):
            self.record_indices(self._padded[r: self._total: self.num_replicas][lo: lo + batch_size])

    def record_indices(self, indices) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(int(i) for i in state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Re-shard the unprocessed indices over this round's workers."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        total = self.num_samples * self.num_replicas
        self._padded = remaining + remaining[: total - len(remaining)]  # every worker the same count
        self._total = total
        self.indices = self._padded[self.rank: total: self.num_replicas]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

