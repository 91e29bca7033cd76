"""Mixed precision with `torch.amp.GradScaler` and a DistributedOptimizer.

A GradScaler decides on its own worker's gradients whether a step has inf/NaN and is
skipped. Left alone, one worker would skip `optimizer.step()` (and with it the gradient
exchange) while the others wait in it, and with overlap the exchanged, still-scaled
gradients would overwrite the unscaled ones before the update. So the DistributedOptimizer
declares `_step_supports_amp_scaling`: `scaler.step(optimizer)` then hands the scaler to
`optimizer.step(grad_scaler=...)`, which

1. exchanges the (scaled) gradients, unless `synchronize()` already did;
2. unscales the exchanged gradients (`scaler.unscale_`), unless the script already did;
3. makes every worker agree on inf/NaN (one tiny all-reduce of the flag) and writes the
   agreed flag into the scaler, so `scaler.update()` changes the scale alike everywhere;
4. steps the wrapped optimizer only when no worker saw inf/NaN.

Both the plain loop (`scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`)
and Horovod's documented one (`opt.synchronize(); scaler.unscale_(opt); with
opt.skip_synchronize(): scaler.step(opt)`, e.g. to clip) work. Reading the scaler's stage
uses its per-optimizer record (`_per_optimizer_states`), the only place GradScaler keeps it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UserError


def _stage(scaler, opt) -> str:
    state = scaler._per_optimizer_states[id(opt)]
    return state["stage"].name  # READY, UNSCALED or STEPPED


def scaled_step(opt, scaler, closure=None):
    """`scaler.step(opt)` for a DistributedOptimizer (see the module docstring)."""
    if not opt.sync.synchronous:
        raise UserError(f"GradScaler with sync='{opt.sync}': the parameter servers apply the pushed gradients, so a "
                        "skipped step cannot be agreed; use sync mode for mixed precision")
    unscaled = _stage(scaler, opt) == "UNSCALED"
    exchanged_here = False
    if not opt._synced:
        if opt._skip:
            raise UserError("scaler.step(optimizer) inside skip_synchronize() needs optimizer.synchronize() first")
        if unscaled and opt.engine.owned_by(opt):
            raise UserError("scaler.unscale_(optimizer) ran while the gradients were still being exchanged "
                            "(overlap): call optimizer.synchronize() before scaler.unscale_(optimizer)")
        opt.synchronize()
        exchanged_here = True
    if not unscaled:
        scaler.unscale_(opt)  # on the exchanged gradients
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    flag = float(sum(v.item() for v in found.values()) > 0)
    if unscaled and exchanged_here:  # unscaled before the exchange: look at what came back
        flag = max(flag, float(not all(torch.isfinite(p.grad).all() for _, p in opt._named if p.grad is not None)))
    flag = _agree(opt, flag)
    for v in found.values():
        v.fill_(flag)
    opt._synced = False
    if flag:
        return None  # every worker skips this step; scaler.update() lowers the scale everywhere
    if opt._out:  # sitting this step out (a probe's step on copies): its gradients are not applied
        for _, p in opt._named:
            p.grad = None
    return opt._inner.step(closure)


def _agree(opt, flag: float) -> float:
    """1.0 when any worker saw inf/NaN."""
    ctx = opt.engine.ctx
    if not ctx.distributed or ctx.num_workers == 1:
        return flag
    t = torch.tensor([flag], dtype=torch.float32)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("agreeing on inf/NaN gradients (GradScaler)", [], err) from None
    return float(t.item())
