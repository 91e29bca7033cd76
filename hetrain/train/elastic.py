"""Elastic training state, in the shape Horovod Elastic users know.

    loader = hetrain.BalancedLoader(dataset, global_batch=256, optimizer=opt, model=model)
    state = hetrain.elastic.State(model=model, optimizer=opt, loader=loader)

    @hetrain.elastic.run
    def train(state):
        for epoch in loader.epochs(EPOCHS):     # from the committed position on
            for x, y in loader:
                ...                             # forward, backward, opt.step()
                if loader.step % 5 == 0:
                    state.commit()              # after opt.step(): the position is past this step

    train(state)

(With a `GlobalBatchSampler` instead of the loader: `for epoch in sampler.epochs(N):
for step in sampler.steps():`, committing at the top of a step, before its update.)

`State` holds objects with `state_dict()`/`load_state_dict()` (model, optimizer,
loader or sampler...), sharded optimizers (`hetrain.shard`: their parameters and
optimizer state are committed as shards, below) and plain values (numbers, strings,
lists and dicts of them), each an attribute (`state.epoch`). `commit()` snapshots them all, in memory and on disk:
the first `replicas` workers each write the commit atomically, with a digest, into
their own machine's folder (`<run_dir>/elastic/<machine>/`), so a damaged file or a
lost machine still leaves an intact copy. `restore()` rolls back to the in-memory
commit.

A sharded optimizer's state is on no one worker: at a commit every worker writes its
own spans (`<directory>/shards/<commit>-<name>/`, train/shard/checkpoint.py) before the
replicas write the rest, so a commit on disk always has its shards. They are loaded on
whatever workers the job has when it resumes (resharded), and `restore()` reads them
back from there too. The folder must be one that every worker sees (one host, or a shared
file system). The two newest sharded commits are kept.

hetrain recovers the way torchrun does, by restarting processes: when a process dies
or hangs, the launcher (`--max-restarts`) starts a new round of the job, and `run`
begins by `sync()`: the workers agree on the newest intact commit any of them holds,
the lowest rank holding it broadcasts it, and everyone loads it; with no commit yet,
rank 0's initial state is broadcast, so all ranks start equal. Nothing from the
network is unpickled: commits are loaded with `torch.load(weights_only=True)`.

Requests are honoured at commits (and at `check()`): SIGUSR1 (a scheduler resizing the
job) or the launcher asking the workers to stop so that a machine can join. All
workers agree on it with one tiny all-reduce, commit, leave the job in order and exit
with EXIT_STOPPED or EXIT_RESIZE; the launcher then stops or starts the next round.

The launcher starts processes with SIGUSR1 blocked, so a request that arrives before
a script is ready stays pending instead of killing it; `on_stop_request` installs the
handler and only then unblocks, delivering any pending request at once.
"""
from __future__ import annotations

import functools
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UserError
from ..runtime.context import init as _join
from ..runtime.launch import EXIT_RESIZE, EXIT_STOPPED
from ..runtime.rounds import COMMITS, RESIZE
from .checkpoint import CommitStore, dumps, loads
from .shard.sharded import ShardedOptimizer

__all__ = ["EXIT_RESIZE", "EXIT_STOPPED", "State", "StopAtCommit", "on_stop_request", "run", "load_committed"]

_STOP: threading.Event | None = None
# run on every worker before each commit's snapshot, in the order registered (the same on
# every worker): a DistributedOptimizer whose workers sit out brings them up to date there
_BEFORE_COMMIT: list = []


def before_commit(fn) -> None:
    """Run `fn()` on every worker before each commit's snapshot (a collective may run in
    it: every worker commits at the same step). hetrain.api.members registers each
    optimizer's: a worker sitting out of the gradient exchange holds older parameters,
    which its commit must not hold. Held for the process's life, as the optimizers
    registered for hetrain.join are, so every worker runs the same hooks whatever its
    garbage collector did."""
    _BEFORE_COMMIT.append(fn)


def on_stop_request(*, include_sigterm: bool = True) -> threading.Event:
    """Return the Event that is set when this process is asked to stop (SIGUSR1, and
    SIGTERM unless `include_sigterm=False`). The same Event on every call."""
    global _STOP
    if _STOP is None:
        _STOP = threading.Event()
    event = _STOP

    def _handler(signum, frame) -> None:
        event.set()

    signal.signal(signal.SIGUSR1, _handler)
    if include_sigterm:
        signal.signal(signal.SIGTERM, _handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return event


class StopAtCommit(Exception):
    """Every worker agreed to stop at this commit (raised by commit/check, caught by `run`)."""

    def __init__(self, code: int, why: str):
        super().__init__(why)
        self.code = code


_PLAIN = (bool, int, float, str, type(None))


def _check_plain(name: str, value) -> None:
    """Values must load back under weights_only=True: plain scalars, tensors, and lists,
    tuples and dicts (with string or int keys) of them."""
    if type(value) in _PLAIN or isinstance(value, torch.Tensor):  # exact types: numpy scalars subclass float
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(f"{name}[{i}]", v)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise UserError(f"elastic State value {name!r} has a key of type {type(k).__name__}; use str or int keys")
            _check_plain(f"{name}[{k!r}]", v)
        return
    raise UserError(f"elastic State value {name!r} is a {type(value).__name__}, which a commit cannot hold; give "
                    "objects with state_dict()/load_state_dict(), or plain numbers, strings, lists and dicts "
                    "(convert numpy numbers with int() or float())")


def _refuse_sharded_models(objects: dict, sharded: dict) -> None:
    """A sharded model's parameters are committed with its sharded optimizer; its own
    `state_dict` holds only what this worker has gathered (or nothing, at stage 3)."""
    for name, item in objects.items():
        for opt_name, opt in sharded.items():
            if item is opt.model:
                raise UserError(f"elastic State item {name!r} is the model sharded by {opt_name!r}: its parameters "
                                f"are committed with {opt_name!r}; leave the model out of the State")


class State:
    """Everything a job needs to continue where it left off (see the module docstring).

    `directory`: where commits go (default `<run_dir>/elastic`). `replicas`: how many
    workers (ranks 0..replicas-1) write each commit, each on its own machine.
    """

    _own = ("_objects", "_sharded", "_values", "_seq", "_memory", "_ctx", "_dir", "_replicas", "_stop",
            "restored_from", "round", "_t_commit")

    def __init__(self, *, directory: str | Path | None = None, replicas: int = 2, **items):
        if replicas < 1:
            raise UserError(f"elastic State needs replicas >= 1, got {replicas}")
        ctx = _join()
        objects, values, sharded = {}, {}, {}
        for name, item in items.items():
            if name.startswith("_") or name in self._own or hasattr(type(self), name):
                raise UserError(f"elastic State cannot hold an item called {name!r}; rename it")
            if isinstance(item, ShardedOptimizer):
                sharded[name] = item
            elif hasattr(item, "state_dict") and hasattr(item, "load_state_dict"):
                objects[name] = item
            else:
                _check_plain(name, item)
                values[name] = item
        _refuse_sharded_models(objects, sharded)
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_sharded", sharded)
        object.__setattr__(self, "_values", list(values))
        for name, v in values.items():
            object.__setattr__(self, name, v)
        run_dir = ctx.env.run_dir if ctx.env else "runs/single"
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_dir", Path(directory) if directory is not None else Path(run_dir) / "elastic")
        object.__setattr__(self, "_replicas", replicas)
        object.__setattr__(self, "_seq", 0)
        object.__setattr__(self, "_memory", None)
        object.__setattr__(self, "_stop", on_stop_request(include_sigterm=False))
        object.__setattr__(self, "restored_from", None)  # commit number restored by sync(), if any
        object.__setattr__(self, "round", ctx.env.restart if ctx.env else 0)
        object.__setattr__(self, "_t_commit", 0.0)

    def __getattr__(self, name):
        for kind in ("_objects", "_sharded"):
            items = object.__getattribute__(self, kind)
            if name in items:
                return items[name]
        raise AttributeError(name)

    def __setattr__(self, name, value) -> None:
        if name in self._objects or name in self._sharded:
            raise UserError(f"elastic State item {name!r} is an object; load into it instead of replacing it")
        if name not in self._values:
            self._values.append(name)
        _check_plain(name, value)
        object.__setattr__(self, name, value)

    # ---- who does what ------------------------------------------------------------------
    @property
    def _rank(self) -> int:
        return self._ctx.rank if self._ctx.distributed else 0

    @property
    def _nworkers(self) -> int:
        return self._ctx.num_workers

    @property
    def _machine(self) -> str:
        return self._ctx.machine_name or "local"

    @property
    def commits(self) -> int:
        """Commits so far (the number of the last one)."""
        return self._seq

    def _replica(self) -> CommitStore:
        return CommitStore(self._dir, self._machine)

    # ---- snapshots ----------------------------------------------------------------------
    def _snapshot(self) -> dict:
        return {"seq": self._seq, "meta": {"round": self.round, "time": time.time(), "workers": self._nworkers},
                "objects": {k: o.state_dict() for k, o in self._objects.items()},
                "values": {k: getattr(self, k) for k in self._values}}

    def _load(self, snap: dict) -> None:
        for k, o in self._objects.items():
            if k in snap["objects"]:
                o.load_state_dict(snap["objects"][k])
        for k, v in snap["values"].items():
            object.__setattr__(self, k, v)
            if k not in self._values:
                self._values.append(k)
        object.__setattr__(self, "_seq", int(snap["seq"]))

    def _shards(self, seq: int, name: str) -> Path:
        return self._dir / "shards" / f"{seq:08d}-{name}"

    def _write(self) -> None:
        """The next commit: every worker brought up to date (`before_commit`), the sharded
        optimizers' shards (every worker its own; a collective), then the snapshot in
        memory and on the replica workers."""
        for fn in _BEFORE_COMMIT:
            fn()
        seq = self._seq + 1
        for name, opt in self._sharded.items():
            opt.save(self._shards(seq, name))  # returns once every worker wrote its spans
        object.__setattr__(self, "_seq", seq)
        data = dumps(self._snapshot())
        object.__setattr__(self, "_memory", data)
        if self._rank < self._replicas:
            self._replica().save(seq, data)
        if self._sharded and self._rank == 0:  # the two newest stay: the newest replica may be damaged
            for old in (self._dir / "shards").glob("*-*"):
                num = old.name.split("-", 1)[0]
                if num.isdigit() and int(num) < seq - 1:
                    shutil.rmtree(old, ignore_errors=True)

    def _load_shards(self, seq: int) -> None:
        """Every sharded optimizer from commit `seq`'s shards (a collective; resharded onto
        this run's workers)."""
        for name, opt in self._sharded.items():
            where = self._shards(seq, name)
            if not (where / "meta.pt").is_file():
                raise UserError(f"commit {seq} has no shards of {name!r} in {where}: the elastic directory must "
                                "be one every worker sees (one host, or a shared file system)")
            opt.load(where)

    def commit(self) -> None:
        """Snapshot everything (in memory, and on disk on the replica workers; shards on
        every worker), then honour any stop or resize request (raises StopAtCommit,
        which `run` handles). Call it on every worker at the same step."""
        t0 = time.perf_counter()
        self._write()
        if self._rank == 0 and self._ctx.store is not None:
            try:
                self._ctx.store.add(COMMITS, 1)  # the launcher's progress signal
            except Exception:
                pass
        object.__setattr__(self, "_t_commit", self._t_commit + time.perf_counter() - t0)
        self._honour_requests(committed=True)

    def check(self) -> None:
        """Honour a stop or resize request now (committing first) instead of at the next
        commit. A tiny all-reduce among the workers: call it on all of them, same step."""
        self._honour_requests(committed=False)

    def restore(self) -> None:
        """Roll back to the last commit held in memory (this process's own; a sharded
        optimizer's shards from the commit's folder: then a collective)."""
        if self._memory is None:
            raise UserError("nothing committed yet: call state.commit() before state.restore()")
        self._load(loads(self._memory))
        if self._sharded:
            self._load_shards(self._seq)

    def _honour_requests(self, committed: bool) -> None:
        ctx = self._ctx
        stop = 1.0 if self._stop.is_set() else 0.0
        resize = 0.0
        if self._rank == 0 and ctx.store is not None:
            try:
                resize = 1.0 if ctx.store.check([RESIZE]) else 0.0
            except Exception:
                resize = 0.0
        flags = torch.tensor([stop, resize], dtype=torch.float64)
        if ctx.distributed and self._nworkers > 1:
            try:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctx.worker_group)
            except RuntimeError as err:
                raise ctx.peer_error("agreeing on stop requests at a commit", [], err) from None
        if not flags.any():
            return
        if not committed:
            self._write()
        if flags[0] > 0:
            raise StopAtCommit(EXIT_STOPPED, f"stopped on request at commit {self._seq}")
        raise StopAtCommit(EXIT_RESIZE, f"stopped at commit {self._seq} so that machines can join the job")

    # ---- after a (re)start ----------------------------------------------------------------
    def sync(self) -> None:
        """Make every worker hold the newest intact commit any of them has (or rank 0's
        state when there is none yet)."""
        ctx = self._ctx
        replica = self._replica()
        found = replica.newest()
        for bad in replica.damaged:
            print(f"hetrain.elastic: {ctx.describe(self._rank)}: commit file {bad} is damaged (digest mismatch or "
                  "truncated); using an older or another machine's copy", file=sys.stderr, flush=True)
        seq = found[0] if found else 0
        data = found[1] if found else None
        if ctx.distributed and self._nworkers > 1:
            best = torch.tensor([seq], dtype=torch.int64)
            self._allreduce(best, dist.ReduceOp.MAX, "agreeing on the newest commit")
            best_seq = int(best.item())
            holder = torch.tensor([self._rank if seq == best_seq else 1 << 30], dtype=torch.int64)
            self._allreduce(holder, dist.ReduceOp.MIN, "choosing the worker that holds it")
            src = int(holder.item()) if best_seq > 0 else 0
            if self._rank == src:
                data = data if best_seq > 0 else dumps(self._snapshot())
                size = torch.tensor([len(data)], dtype=torch.int64)
            else:
                size = torch.zeros(1, dtype=torch.int64)
            self._broadcast(size, src)
            buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self._rank == src
                   else torch.empty(int(size.item()), dtype=torch.uint8))
            self._broadcast(buf, src)
            data = buf.numpy().tobytes()
            seq = best_seq
        if data is None:  # one process, nothing committed yet: start as constructed
            return
        self._load(loads(data, f"commit {seq}"))
        object.__setattr__(self, "_memory", data)
        if seq > 0 and self._sharded:
            self._load_shards(seq)
        if seq > 0:
            object.__setattr__(self, "restored_from", seq)
            if self._rank == 0:
                where = ""
                pos = next((o for o in self._objects.values() if hasattr(o, "epoch") and hasattr(o, "step")), None)
                if pos is not None:  # a sampler or a BalancedLoader: the data position
                    where = f" (epoch {pos.epoch}, step {pos.step})"
                print(f"hetrain.elastic: round {self.round} resumed from commit {seq}{where} on "
                      f"{self._nworkers} worker(s)", flush=True)

    def _allreduce(self, t: torch.Tensor, op, what: str) -> None:
        try:
            dist.all_reduce(t, op=op, group=self._ctx.worker_group)
        except RuntimeError as err:
            raise self._ctx.peer_error(what, [], err) from None

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        try:
            dist.broadcast(t, src=src, group=self._ctx.worker_group)
        except RuntimeError as err:
            raise self._ctx.peer_error("broadcasting the committed state", [src], err) from None


def run(func):
    """Decorate the training function `func(state, ...)`: restore the newest commit
    first, and turn an agreed stop into the exit code the launcher expects."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise UserError("@hetrain.elastic.run: the training function's first argument must be a "
                            "hetrain.elastic.State")
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except StopAtCommit as stop:
            if state._rank == 0:
                print(f"hetrain.elastic: {stop}", flush=True)
            # hetrain.shutdown (registered at exit by hetrain.init) leaves the job in order
            raise SystemExit(stop.code) from None

    return wrapper


def load_committed(directory: str | Path) -> dict | None:
    """The newest intact commit under an elastic directory (any replica), as saved:
    {"seq", "meta", "objects": {name: state_dict}, "values": {name: value}}; None if none."""
    best = None
    root = Path(directory)
    if not root.is_dir():
        return None
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        found = CommitStore(root, sub.name).newest()
        if found and (best is None or found[0] > best[0]):
            best = found
    return loads(best[1]) if best else None
