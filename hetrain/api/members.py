"""Who exchanges gradients in a step: the workers that train on samples in it.

A balanced job (hetrain.BalancedLoader) gives a worker that would not make the step
faster a share of 0 samples (`hetrain.perf.steptime.useful_workers`,
`hetrain.perf.exchangeset`). Such a worker has no gradient to add, and taking part in the
exchange anyway costs the workers that do train a collective with one more member (a
GPU beside CPU workers ran at a quarter of its own speed for it). So the step's
exchange runs among the workers with samples only: the whole job's engine when every
worker trains, else an engine on a group of those workers (comm/group.py
`exchange_group`), one per set, made by every worker when the set is first used. A
set of one worker moves nothing. In a job with summation servers, a set short of the
whole job all-reduces among its members, as any subgroup engine does: the servers sum
for the whole job's workers and see only the steps every worker takes part in.

Every worker knows the set of every step: it is the agreed split's workers with
samples (every worker solves the same split from the same exchanged numbers), so all
agree on it without a message, and all know who holds the current parameters: the
workers of the last step's set. A worker sitting out keeps the parameters it had; when
a set takes in a worker of no set before it (a probe, a new split), the parameters and
the optimizer state are first broadcast to every worker from the lowest rank of the
last set (`resync`), so its gradients are computed on the current model; the model's
buffers (batch-norm statistics) go with them where the optimizer was told the model
(`DistributedOptimizer.track_buffers`, which BalancedLoader calls). An elastic commit
while some worker sits out first brings every worker to the last set's state
(`up_to_date`), so whichever worker's commit is restored holds the trained state.
"""
from __future__ import annotations

import json
import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import UserError
from ..train.elastic import before_commit

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class ExchangeMembers:
    """The gradient exchange's members, step by step, for one DistributedOptimizer.

    `engine_for(ranks)` is the engine of a set (None where this worker is not in it);
    `enter(ranks, named, optimizer)` re-synchronises first where the set takes in a
    worker that was not in the last one. Counters for the step summary and tests:
    `exchanges` (steps this worker exchanged in), `sat_out`, `resyncs`.
    `named`/`optimizer`: what an elastic commit brings up to date (`up_to_date`, run by
    `hetrain.train.elastic.State.commit` on every worker); `module`: the model whose
    buffers travel with the parameters (`track`)."""

    def __init__(self, job_engine, named=None, optimizer: torch.optim.Optimizer | None = None):
        self.job = job_engine
        self.named, self.optimizer = named, optimizer
        self.module: torch.nn.Module | None = None
        if named is not None:
            before_commit(self.up_to_date)
        self.ctx = job_engine.ctx
        topo = self.ctx.topology if self.ctx.distributed else None
        self.workers: tuple[int, ...] = tuple(topo.worker_ranks) if topo is not None else (self.ctx.rank,)
        self.last: tuple[int, ...] = self.workers  # who holds the current parameters
        self._engines: dict[tuple[int, ...], object] = {}
        self._ranks: dict[tuple, tuple[int, ...]] = {}  # see ranks_of
        self.exchanges = self.sat_out = self.resyncs = 0

    def ranks_of(self, workers: Sequence[int]) -> tuple[int, ...]:
        """Job ranks of worker indices (the balancer's order: the job's workers); the
        answers kept per set asked for (a loop asks for the same set step after step)."""
        key = tuple(workers)
        got = self._ranks.get(key)
        if got is None:
            idx = sorted({int(i) for i in workers})
            if not idx or idx[0] < 0 or idx[-1] >= len(self.workers):
                raise UserError(f"set_exchange needs worker indices in 0..{len(self.workers) - 1} (at least one), "
                                f"got {list(workers)}")
            got = self._ranks[key] = tuple(self.workers[i] for i in idx)
        return got

    def switch(self, workers, in_flight: bool, named, optimizer: torch.optim.Optimizer, step: bool = True):
        """`DistributedOptimizer.set_exchange`: the engine of the set of worker indices
        `workers` (None: every worker), re-synchronising first where needed (`enter`);
        None where this worker sits out. `in_flight`: an exchange of the set in use has
        not ended, so the set may not change."""
        ranks = self.ranks_of(workers) if workers is not None and self.ctx.distributed else self.workers
        if ranks != self.last and in_flight:  # (the same set: nothing changes)
            raise UserError("set_exchange() with another set while this optimizer's exchange is in flight: call "
                            "it before zero_grad(), once the step before has ended with step()")
        self.enter(ranks, named, optimizer, step)
        return self.engine_for(ranks)

    def engine_for(self, ranks: tuple[int, ...]):
        """The engine that exchanges among `ranks` (None: this worker sits out). Every
        worker asks at every step, with the same set (a new set's group is made then)."""
        if ranks == self.workers:
            return self.job
        if ranks not in self._engines:
            from ..comm.engine import PushPull
            from ..comm.group import exchange_group

            group = exchange_group(self.ctx, ranks)  # every worker, member or not (see there)
            eng = PushPull(self.ctx, group) if group.member else None
            if eng is not None:
                eng.stats = self.job.stats  # one account: the balancer reads the step's exchange time there
            self._engines[ranks] = eng
        eng = self._engines[ranks]
        if eng is not None:
            eng._idle = self.job._idle  # the re-plan that runs while the step's exchange waits
        return eng

    def enter(self, ranks: tuple[int, ...], named, optimizer: torch.optim.Optimizer, step: bool = True) -> None:
        """The step exchanging among `ranks` starts: where one of them was not in the
        last set, every worker takes part in `resync` (a collective over the job's workers)."""
        if any(r not in self.last for r in ranks):
            self.resync(named, optimizer, min(self.last))
        self.last = ranks
        if not step:
            return
        if self.ctx.rank in ranks:
            self.exchanges += 1
        else:
            self.sat_out += 1

    def track(self, module: torch.nn.Module) -> None:
        """`DistributedOptimizer.track_buffers`: `module`'s buffers are re-synchronised
        with the parameters."""
        if not isinstance(module, torch.nn.Module):
            raise UserError(f"track_buffers takes the model (a torch.nn.Module), got {type(module).__name__}")
        self.module = module

    def up_to_date(self) -> None:
        """Before an elastic commit's snapshot (every worker, same step): where some worker
        sits out, its parameters, optimizer state and buffers are those of the step it
        left at; every worker takes the last set's (`resync` from its lowest rank), so
        each commit holds the exchanging workers' state, whichever worker's is restored.
        `last` stays the set: the workers out fall behind again at its next update."""
        if self.named is not None and self.last != self.workers:
            self.resync(self.named, self.optimizer, min(self.last))

    def resync(self, named, optimizer: torch.optim.Optimizer, source: int) -> None:
        """Broadcast the parameters, the optimizer's state and the tracked model's buffers
        (`track`) from job rank `source` to every worker (the whole worker group, so one
        collective serves any set; it runs only when a worker rejoins, or at a commit while
        one sits out). The structure travels as JSON (never a pickle): a worker that sat
        out from the start may hold no optimizer state yet."""
        ctx = self.ctx
        if not ctx.distributed or len(self.workers) == 1:
            return
        params = [p for _, p in named]
        buffers = [(n, b) for n, b in self.module.named_buffers()] if self.module is not None else []
        desc = _describe(optimizer, params, buffers) if ctx.rank == source else ""
        desc = json.loads(_broadcast_text(ctx, desc, source))
        if [int(n) for n in desc["numel"]] != [p.numel() for p in params]:
            raise UserError(f"re-synchronising parameters from {ctx.describe(source)}: its parameters have "
                            f"{desc['numel']} elements, this worker's {[p.numel() for p in params]}; every worker "
                            "must train the same model")
        mine = _buffer_specs(buffers)
        if desc["buffers"] != mine:
            raise UserError(f"re-synchronising the model's buffers from {ctx.describe(source)}: its buffers are "
                            f"{desc['buffers']}, this worker's {mine}; every worker must train the same model and "
                            "call track_buffers with it")
        tensors = ([p.data for p in params] + _state_tensors(optimizer, params, desc["state"])
                   + [b.data for _, b in buffers])
        _broadcast_tensors(ctx, tensors, source)
        self.resyncs += 1


def _buffer_specs(buffers) -> list:
    """Name, dtype and shape of each buffer: what the source and a receiver must share."""
    return [[name, str(b.dtype), list(b.shape)] for name, b in buffers]


def _describe(optimizer: torch.optim.Optimizer, params, buffers) -> str:
    """The optimizer state's structure, per parameter: tensors by dtype, shape and place
    (with the parameter, or on the host), plain numbers by value; and the buffers'."""
    out = []
    for p in params:
        entry = {}
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                entry[str(key)] = ["t", str(v.dtype), list(v.shape), v.device == p.device]
            elif v is None or isinstance(v, (bool, int, float)) and (not isinstance(v, float) or math.isfinite(v)):
                entry[str(key)] = ["v", v]
            else:
                raise UserError(f"optimizer state {key!r} ({type(v).__name__}) cannot be re-synchronised to a worker "
                                "that rejoins the exchange; use BalanceConfig(leave=False) to keep every worker in "
                                "every exchange")
        out.append(entry)
    return json.dumps({"numel": [p.numel() for p in params], "state": out, "buffers": _buffer_specs(buffers)})


def _state_tensors(optimizer: torch.optim.Optimizer, params, state: list) -> list[torch.Tensor]:
    """This worker's state tensors in the order of `state` (the source's description),
    made where missing or of another shape, and plain values set."""
    tensors = []
    for p, entry in zip(params, state):
        mine = optimizer.state[p]
        for key in [k for k in mine if str(k) not in entry]:
            del mine[key]
        for key, spec in entry.items():
            if spec[0] == "v":
                mine[key] = spec[1]
                continue
            dtype = _DTYPES.get(spec[1])
            if dtype is None:
                raise UserError(f"optimizer state {key!r} has dtype {spec[1]}, which re-synchronisation does not carry")
            device = p.device if spec[3] else torch.device("cpu")
            cur = mine.get(key)
            if not (isinstance(cur, torch.Tensor) and cur.dtype == dtype and list(cur.shape) == spec[2]
                    and cur.device == device):
                mine[key] = cur = torch.zeros(spec[2], dtype=dtype, device=device)
            tensors.append(cur)
    return tensors


def _broadcast_text(ctx, text: str, source: int) -> str:
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    _broadcast(ctx, size, source)
    buf = data if ctx.rank == source else torch.zeros(int(size.item()), dtype=torch.uint8)
    _broadcast(ctx, buf, source)
    return bytes(buf.numpy()).decode()


def _broadcast_tensors(ctx, tensors: list[torch.Tensor], source: int) -> None:
    """One broadcast per dtype, over the host (CUDA tensors staged through it: this runs
    only when a worker rejoins)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            if ctx.rank == source:
                flat = torch.cat([t.detach().reshape(-1).cpu() for t in group])
            else:
                flat = torch.empty(sum(t.numel() for t in group), dtype=dtype)
            if not flat.numel():
                continue
            _broadcast(ctx, flat.view(torch.uint8), source)
            if ctx.rank != source:
                at = 0
                for t in group:
                    t.copy_(flat[at: at + t.numel()].view(t.shape))
                    at += t.numel()


def _broadcast(ctx, t: torch.Tensor, source: int) -> None:
    try:
        dist.broadcast(t, src=source, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("re-synchronising the parameters of a worker that rejoins the exchange",
                             [source], err) from None
