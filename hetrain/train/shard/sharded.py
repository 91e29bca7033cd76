"""`ShardedOptimizer`: sharded data parallelism (ZeRO stages 1-3) with uneven shards,
made by `hetrain.shard(model, optimizer, ShardConfig(...))` in the style of FSDP's
`fully_shard` (the model is changed in place, hooks are added) and ZeRO's optimizer
wrapper (the step is applied by each owner to its span only).

One step, per unit (a top-level module; the root's own parameters are one more):

- forward: stage 3 gathers the unit from its owners in a forward pre-hook, starts
  gathering the next unit (prefetch), and releases the unit after its forward;
- backward: stage 3 gathers the unit again when the gradient of its output arrives
  (and starts the unit before it); once every parameter of the unit has its gradient
  (post-accumulate hooks), stages 2-3 flatten the unit's gradients, weight them by this
  worker's batch share (b_i / B: workers may train on unequal batches, as hetrain's
  balancer gives them) and reduce each owner's span onto its owner while backward goes
  on (one unit in flight), releasing the rest; stage 1 all-reduces at `step()`;
- step: each owner's wrapped optimizer steps its spans; stages 1-2 then broadcast the
  updated spans to every worker (stage 3 gathers at the next forward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import UserError
from ...perf.shardmem import ShardModel, shares_by_memory, whole_bytes
from . import collectives as C
from .cap import MemoryCap
from .config import ShardConfig
from .unit import FlatUnit


def _units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The root's own parameters (if any), then each top-level child's; a parameter
    shared by two modules belongs to the first."""
    seen: set[int] = set()
    out = []
    own = [p for p in model._parameters.values() if p is not None]
    for p in own:
        seen.add(id(p))
    if own:
        out.append(("", model, own))
    for name, child in model.named_children():
        ps = [p for p in child.parameters() if id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            out.append((name, child, ps))
    if not out:
        raise UserError("the model has no parameters to shard")
    return out


def _rebuild(optimizer: torch.optim.Optimizer, shards: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The same optimizer class and settings, over this worker's spans only."""
    if len(optimizer.param_groups) != 1:
        raise UserError(f"shard needs an optimizer with one parameter group, not {len(optimizer.param_groups)}; "
                        "give every parameter the same settings")
    if optimizer.state:
        raise UserError("the optimizer has state already; shard the model before the first step")
    new = type(optimizer)(shards, **optimizer.defaults)
    new.param_groups[0].update({k: v for k, v in optimizer.param_groups[0].items() if k != "params"})
    return new


class ShardedOptimizer:
    """The sharded model's optimizer: `zero_grad()`, `set_batch_size()`, backward,
    `step()`; `save(dir)` / `load(dir)` write and read a checkpoint that any number of
    workers can load (train/shard/checkpoint.py)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: ShardConfig,
                 group=None, cap: MemoryCap | None = None, device: torch.device | str | None = None) -> None:
        self.model, self.config, self.group, self.cap = model, config, group, cap
        self.stage = config.stage
        on = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        self.ranks = C.global_ranks(group, self.size)
        units = _units(model)
        device = torch.device(device) if device is not None else units[0][2][0].device
        self.weights = self._weights([sum(p.numel() for p in ps) for _, _, ps in units], device)
        self.units = [FlatUnit(name, mod, ps, self.weights, self.rank, self.ranks, group, self.stage, device,
                               config.exchange)
                      for name, mod, ps in units]
        self.optimizer = _rebuild(optimizer, [u.shard for u in self.units])
        self._batch, self._total = 1, self.size
        self._inflight: list[FlatUnit] = []
        self._reduced: set[int] = set()
        self._hooks = []
        for k, u in enumerate(self.units):
            self._hooks.append(u.module.register_forward_pre_hook(lambda m, a, k=k: self._before_forward(k)))
            self._hooks.append(u.module.register_forward_hook(lambda m, a, out, k=k: self._after_forward(k, out)))
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, k=k: self._grad_ready(k)))
        self._check("after sharding")

    # ---- setup ------------------------------------------------------------------------
    def _weights(self, numels: list[int], device: torch.device) -> tuple[float, ...]:
        cfg = self.config
        if cfg.weights is not None:
            if len(cfg.weights) != self.size:
                raise UserError(f"ShardConfig.weights has {len(cfg.weights)} entries but the job has {self.size} "
                                "workers; give one memory weight per worker")
            return tuple(float(w) for w in cfg.weights)
        free = cfg.memory_bytes
        if free is None:
            free = self.cap.cap_bytes if self.cap is not None else _free_bytes(device)
        mine = torch.tensor([float(free), float(cfg.activation_bytes)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        if self.size > 1:
            dist.all_gather(every, mine, group=self.group)
        else:
            every = [mine]
        model = ShardModel("model", tuple(numels))
        whole = [whole_bytes(model, self.stage, 0) for _ in every]
        return tuple(shares_by_memory([float(e[0]) for e in every], [float(e[1]) for e in every], whole))

    # ---- hooks ------------------------------------------------------------------------
    def _before_forward(self, k: int) -> None:
        u = self.units[k]
        u.pending = len(u.params)
        u.bw_armed = True
        u.ensure_gathered()  # stage 1-2: the last step's exchange of this unit, left running until now
        if self.stage == 3 and self.config.prefetch and k + 1 < len(self.units):
            self.units[k + 1].start_gather()

    def _after_forward(self, k: int, out) -> None:
        if self.stage != 3:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, k=k: self._before_backward(k))
        self.units[k].release()

    def _before_backward(self, k: int) -> None:
        u = self.units[k]
        if not getattr(u, "bw_armed", False):
            return
        u.bw_armed = False
        u.ensure_gathered()
        if self.config.prefetch and k > 0:
            self.units[k - 1].start_gather()
        self._check("backward")

    def _grad_ready(self, k: int) -> None:
        u = self.units[k]
        u.pending -= 1
        if u.pending > 0 or self.stage == 1:
            return
        if self._inflight:  # one unit's reduce in flight: its buffer is freed before the next is made
            self._inflight.pop(0).finish_reduce()
        u.start_reduce(self._batch / self._total, all_reduce=False)
        self._inflight.append(u)
        self._reduced.add(k)
        if self.stage == 3:
            u.release()
        self._check("backward")

    def _check(self, where: str) -> None:
        if self.cap is not None:
            self.cap.check(where)

    # ---- the step ---------------------------------------------------------------------
    def set_batch_size(self, batch_size: int, total: int | None = None) -> None:
        """This worker's samples this step (its gradient weighs batch_size / total in the
        sum); `total`: every worker's together, when known (else one all-reduce)."""
        if total is None:
            t = torch.tensor([int(batch_size)], dtype=torch.int64)
            if self.size > 1:
                dist.all_reduce(t, group=self.group)
            total = int(t.item())
        if total <= 0:
            raise UserError(f"the workers' batches add up to {total}; at least one sample is needed")
        self._batch, self._total = int(batch_size), int(total)

    def idle_pass(self, *inputs, total: int | None = None) -> None:
        """A member of the CPU tier (a CPU machine holding optimizer spans, training on no
        samples) calls this where a worker runs its forward and backward: the model on an
        empty batch (`inputs` with 0 rows), so its collectives line up with the workers';
        its gradients weigh 0. Its `step()` then applies the update to its spans on the CPU."""
        self.set_batch_size(0, total)
        out = self.model(*inputs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.stack([t.sum() for t in outs]).sum().backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for u in self.units:
            u.shard.grad = None
            for p in u.params:
                p.grad = None

    def synchronize(self) -> None:
        """Finish every unit's gradient reduction (the rest of `step`'s first half)."""
        scale = self._batch / self._total
        if self.stage == 1:
            prev = None
            for u in self.units:
                u.start_reduce(scale, all_reduce=True)
                if prev is not None:
                    prev.finish_reduce()
                prev = u
            if prev is not None:
                prev.finish_reduce()
        else:
            while self._inflight:
                self._inflight.pop(0).finish_reduce()
            for k, u in enumerate(self.units):  # units no gradient reached (unused): zeros, same order everywhere
                if k not in self._reduced and any(p.grad is not None for p in u.params):
                    u.start_reduce(scale, all_reduce=False)
                    u.finish_reduce()
            self._reduced.clear()

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.synchronize()
        for u in self.units:  # a step without a forward since the last: its exchange first
            C.wait(u.gathering)
        self.optimizer.step()
        self._check("optimizer step")
        if self.stage < 3:
            # every owner's updated spans to every worker, left running: each unit's forward
            # pre-hook waits for its own, so the exchange overlaps the next forward
            for u in self.units:
                u.gathering = u.broadcast_params()
        self._check("step")
        return loss

    # ---- whole parameters -------------------------------------------------------------
    def gather_all(self) -> None:
        """Make every unit's parameters whole and current (stage 3: e.g. to evaluate or
        save the plain model, the next forward releases them again; stages 1-2: the last
        step's exchange finished)."""
        for u in self.units:
            u.ensure_gathered()

    def save(self, directory) -> None:
        """A checkpoint of this worker's spans, loadable on any number of workers."""
        from .checkpoint import save
        save(self, directory)

    def load(self, directory) -> None:
        """Load a checkpoint `save` wrote, on this job's workers and spans (resharded)."""
        from .checkpoint import load
        load(self, directory)

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def _free_bytes(device: torch.device) -> float:
    from ...runtime.memory import memory_limit
    return memory_limit(device).bytes
