"""One pipeline process: a stage replica or a sparse-PS shard, by rank.

Started by the single launcher (`hetrain train` calls it with ``-m
hetrain.pipeline.worker --spec run.json``). Stage replicas run synchronous pipelined
steps (GPipe order: forward every owned micro-batch, then backward) on their device
(emulated, the CPU, or the replica's GPU), exchange activations and their gradients
with the neighbouring stages over gloo point-to-point (pipeline/messages.py: through
pinned host memory for a GPU stage), pull/push embedding rows from the shards, and
average dense gradients among their stage's replicas with push_pull on the stage's
group (comm/group.py). Micro-batch i of a step goes to replica i mod k of a stage with
k replicas, so uneven replica counts between stages fan in and out deterministically.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import p2p
from ..comm.engine import PushPull
from ..comm.group import make_groups
from ..errors import UserError
from ..runtime.context import PeerLostError, init, shutdown
from ..train.checkpoint import load_checkpoint, save_checkpoint
from .data import CTRData, MicroBatchLoader
from .devicemap import check_gpu_memory
from .messages import recv_tensors, send_tensors, wire_for
from .sparse_ps import ShardLayout, ShardState, SparseClient, serve
from .spec import RunSpec
from .stage import StageCompute


class Pacer:
    """Emulated device clock (wall-clock seconds, shared by the processes of a host).

    Each piece of work occupies the device for exactly its emulated time from the cost
    model, starting when both the device is free and its input is ready: the input's
    ready time travels in the message header (the sender's emulated finish time), so
    the emulation does not depend on when the host happens to schedule the receiver.
    ``begin(ready)``, then ``finish(target)`` returns the emulated finish time (to stamp
    outgoing messages), then ``wait()`` sleeps until it. Real work longer than its slot
    makes the device late (counted in ``over``); shorter real work is hidden.
    """

    def __init__(self, on: bool):
        self.on = on
        self.busy_until = 0.0
        self.ready = 0.0
        self.real_s = 0.0
        self.slept_s = 0.0
        self.over = 0

    def begin(self, ready: float) -> None:
        self.ready = ready
        self.t0 = time.time()

    def finish(self, target: float) -> float:
        if self.on:
            self.busy_until = max(self.busy_until, self.ready) + target
        return self.busy_until

    def wait(self) -> None:
        now = time.time()
        self.real_s += now - self.t0
        if not self.on:
            return
        if self.busy_until > now:
            time.sleep(self.busy_until - now)
            self.slept_s += self.busy_until - now
        else:
            self.over += 1
            self.busy_until = now

    def pad(self, target: float) -> float:
        end = self.finish(target)
        self.wait()
        return end


# ------------------------------------------------------------------ checkpoints


def ckpt_path(spec: RunSpec, step: int, name: str) -> Path:
    return Path(spec.ckpt_dir) / f"step-{step:07d}" / f"{name}.pt"


def latest_complete(spec: RunSpec) -> int:
    """Newest checkpointed step for which every stage and every shard saved its file."""
    root = Path(spec.ckpt_dir)
    if not spec.ckpt_dir or not root.is_dir():
        return 0
    names = [f"stage{s}" for s in range(len(spec.stages))] + [f"shard{j}" for j in range(spec.ps_shards)]
    steps = sorted((int(p.name.split("-")[1]) for p in root.glob("step-*") if p.name.split("-")[1].isdigit()),
                   reverse=True)
    for s in steps:
        if all(ckpt_path(spec, s, n).is_file() for n in names):
            return s
    return 0


def save(spec: RunSpec, step: int, name: str, state: dict) -> None:
    save_checkpoint(ckpt_path(spec, step, name), {"step": step, **state})
    # keep this file's two newest generations: a crash while others save leaves a complete older one
    mine = sorted(int(p.parent.name.split("-")[1]) for p in Path(spec.ckpt_dir).glob(f"step-*/{name}.pt"))
    for old in mine[:-2]:
        ckpt_path(spec, old, name).unlink(missing_ok=True)


def want_ckpt(spec: RunSpec, done: int) -> bool:
    return bool(spec.ckpt_dir) and (done == spec.steps or (spec.ckpt_every > 0 and done % spec.ckpt_every == 0))


# ------------------------------------------------------------------ roles


def run_shard(spec: RunSpec, ctx, j: int, layout: ShardLayout, model, start: int, ready) -> dict:
    full = torch.cat([m.table.weight.detach() for m in model.layers if hasattr(m, "table")])
    state = ShardState(layout.shard_of(full, j), spec.optim)
    if start:
        state.load_state_dict(load_checkpoint(ckpt_path(spec, start, f"shard{j}")))
    clients = [r for s, st in enumerate(spec.stages) if _has_emb(model, st) for r in spec.stage_ranks(s)]

    def on_step(done: int) -> None:
        if want_ckpt(spec, done):
            save(spec, done, f"shard{j}", state.state_dict())
        _maybe_fail(spec, ctx.rank, done)

    ready()
    steps = serve(state, clients, spec.model.dim, start_step=start, on_step=on_step, on_error=ctx.peer_error)
    return {"role": f"shard{j}", "rows": int(state.rows.shape[0]), "steps": steps}


def _has_emb(model, st) -> bool:
    return any(getattr(m, "table", None) is not None for m in model.layers[st.start: st.end])


def _maybe_fail(spec: RunSpec, rank: int, done: int) -> None:
    if rank == spec.fail_rank and done == spec.fail_step:
        print(f"fault injection: rank {rank} kills itself after step {done}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# micro-batches whose embedding rows the first stage pulls ahead of the one it computes
# (a shard's answer then has the time of two micro-batches' compute to arrive)
PULL_AHEAD = 2


def _cpu(obj):
    """A state dict with every tensor on the host (checkpoints load anywhere)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def run_stage(spec: RunSpec, ctx, s: int, r: int, layout: ShardLayout, model, group, start: int, ready) -> dict:
    st = spec.stages[s]
    k = st.instances
    last = s == len(spec.stages) - 1
    prev = spec.stage_ranks(s - 1) if s > 0 else []
    nxt = spec.stage_ranks(s + 1) if not last else []
    sizes = spec.mb_sizes()
    mine = [i for i in range(spec.micro_batches) if i % k == r]
    own = sum(sizes[i] for i in mine)  # this replica's samples per step (its push_pull weight)
    wire = wire_for(ctx.device, ctx.describe(ctx.rank))
    client = SparseClient(layout, spec.shard_ranks, spec.model.dim, on_error=ctx.peer_error)
    stage = StageCompute(model, st.start, st.end, layout, wire, client)
    params, names = stage.params, stage.names
    opt = None
    if params:
        opt = (torch.optim.Adagrad(params, lr=spec.optim.lr, eps=spec.optim.eps) if spec.optim.kind == "adagrad"
               else torch.optim.SGD(params, lr=spec.optim.lr))
    if start:
        ck = load_checkpoint(ckpt_path(spec, start, f"stage{s}"))
        with torch.no_grad():
            for n, p in zip(names, params):
                p.copy_(ck["params"][n])
        if opt is not None:
            opt.load_state_dict(ck["optim"])
    # dense gradients: the batch-weighted average over the stage's replicas, on its group
    engine = PushPull(ctx, group) if params and k > 1 else None
    loader = MicroBatchLoader(CTRData(spec.data), spec.batch, sizes, k) if s == 0 else None
    pacer = Pacer(spec.emulate)
    T = st.time_per_sample_s
    ends, losses = [], []
    trace = [] if os.environ.get("HETRAIN_TRACE") else None

    def ev(what: str) -> None:
        if trace is not None:
            trace.append((what, time.time()))
    prof = {"recv_wait_s": 0.0, "step_end_s": 0.0}

    def fail(what, peers, err):
        return ctx.peer_error(what, peers, err)

    def receive(peer: int, i: int, what: str):
        """Tensors of micro-batch i from a neighbour stage; the wait counts as idle time."""
        tw = time.perf_counter()
        try:
            got, ready = recv_tensors(peer, i, wire)
        except PeerLostError:
            raise
        except RuntimeError as err:  # gloo's error: name the neighbour that went away
            raise fail(f"receiving {what} of micro-batch {i}", [peer], err) from None
        pacer.begin(ready)
        prof["recv_wait_s"] += time.perf_counter() - tw
        return got

    def send(ts, dst: int, i: int, ready_at: float, what: str) -> list:
        try:
            return send_tensors(ts, dst, i, ready_at, wire)
        except PeerLostError:
            raise
        except RuntimeError as err:
            raise fail(f"sending {what} of micro-batch {i}", [dst], err) from None

    def send_back(inputs, i: int, ready_at: float) -> list:
        if s == 0:
            return []
        g = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
        return send(g, prev[i % len(prev)], i, ready_at, "input gradients")

    if s == 0:
        loader.get(start, mine[0])  # its first chunk of data, before the clocks start
    ready()
    for step in range(start, spec.steps):
        saved, sends = {}, []
        pacer.busy_until = max(pacer.busy_until, time.time())  # waiting at a step boundary is idle time
        step_loss = torch.zeros((), device=wire.device)
        ahead: dict = {}  # first stage: the next micro-batches, read and their rows' pulls posted

        def read(i: int):
            dense, ids, label = (wire.from_cpu(t) for t in loader.get(step, i))
            inputs = [dense, ids]
            return inputs, label, stage.prepare(inputs, step)

        for n_i, i in enumerate(mine):
            m = sizes[i]
            prepared = None
            if s == 0:  # reading data: the next micro-batch is always ready
                pacer.begin(0.0)
                inputs, label, prepared = ahead.pop(i) if i in ahead else read(i)
                for j in mine[n_i + 1: n_i + 1 + PULL_AHEAD]:  # their rows arrive while this one computes
                    if j not in ahead:
                        ahead[j] = read(j)
            else:
                got = receive(prev[i % len(prev)], i, "activations")
                label, inputs = got[-1], got[:-1]
                for t in inputs:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            ev(f"fwd{i}-in")
            out, pulled = stage.forward(inputs, step, prepared)
            if last:
                loss = model.loss(out[0], label)
                step_loss += loss.detach() * m
                (loss * (m / spec.batch)).backward()
                sends += send_back(inputs, i, pacer.finish(m * T))
                stage.push(pulled, step)
                pacer.wait()
                ev(f"mb{i}-done")
            else:
                sends += send(out + [label], nxt[i % len(nxt)], i, pacer.finish(m * T / 3), "activations")
                saved[i] = (inputs, out, pulled)
                pacer.wait()
                ev(f"fwd{i}-out")
        if not last:
            for i in mine:
                m = sizes[i]
                inputs, out, pulled = saved.pop(i)
                grads = receive(nxt[i % len(nxt)], i, "gradients")
                ev(f"bwd{i}-in")
                fl = [o for o in out if o.is_floating_point()]
                pairs = [(o, g) for o, g in zip(fl, grads) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                end = pacer.finish(m * T * 2 / 3)
                sends += send_back(inputs, i, end)
                stage.push(pulled, step)
                pacer.wait()
                ev(f"bwd{i}-out")
        te = time.perf_counter()
        try:
            p2p.wait_all([w for w, _ in sends], None, "sending to the neighbour stages")  # named below
            ev("sends-done")
            if stage.embs:
                client.commit(step)
            ev("committed")
            pacer.begin(time.time())
            if params:
                if engine is not None:
                    named = []
                    for n, p in zip(names, params):
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        named.append((n, p.grad))
                    # each replica hands over the mean gradient of its own samples (the last stage
                    # scaled each micro-batch's loss by m/B); weighted by its sample count, the
                    # average over the replicas is the gradient of the whole global batch
                    if own != spec.batch:
                        torch._foreach_mul_([g for _, g in named], spec.batch / own)
                    engine.push_pull(named, weight=own)
                    pacer.pad(st.allreduce_s)
                opt.step()
                opt.zero_grad(set_to_none=True)
        except PeerLostError:
            raise
        except RuntimeError as err:
            raise fail("finishing the step (gradients to peers)", [], err) from None
        prof["step_end_s"] += time.perf_counter() - te
        ends.append(time.time())
        ev("step-end")
        if last:
            losses.append(float(step_loss) / own)
        done = step + 1
        if r == 0 and want_ckpt(spec, done):
            save(spec, done, f"stage{s}", {"params": {n: p.detach().cpu().clone() for n, p in zip(names, params)},
                                           "optim": _cpu(opt.state_dict()) if opt else {}})
        _maybe_fail(spec, ctx.rank, done)
    if stage.embs:
        client.stop()
    return {"role": f"stage{s}/replica{r}", "type": st.type, "device": str(wire.device), "step_end_time": ends,
            "loss": losses, "real_s": pacer.real_s, "slept_s": pacer.slept_s, "over_target": pacer.over,
            "micro_batches": len(mine), "start_step": start,
            "comm_s": engine.stats.comm_s if engine else 0.0, "pull_s": stage.pull_s, **prof, **({"trace": trace} if trace else {})}


def setup_barrier(ctx, spec: RunSpec, poll_s: float = 0.05) -> None:
    """Wait until every process has set itself up (model, data, buffers) before the first
    step. Through the job's store, not gloo: gloo waits are bounded by the job's
    `--timeout` (meant for lost peers), and a shard would otherwise start its timed wait
    for requests while a stage on a loaded host is still building its model. A process
    that dies meanwhile ends the job through the launcher, which stops the others."""
    if ctx.store is None:
        return
    key = "hetrain/pipeline/setup"
    ctx.store.add(key, 1)
    deadline = time.monotonic() + max(600.0, 10 * ctx.comm.timeout_s)
    while ctx.store.add(key, 0) < spec.world_size:
        if time.monotonic() > deadline:
            raise ctx.peer_error("waiting for every process to set up", [], TimeoutError("setup barrier"))
        time.sleep(poll_s)


def check_devices(spec: RunSpec, ctx, role) -> None:
    """Before any stage puts its layers on a GPU: each GPU replica checks that its GPU's
    free memory holds every stage placed on that GPU; then every rank waits for every
    check (a barrier), so no check sees memory another replica has taken meanwhile."""
    if role.kind == "stage" and ctx.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(ctx.device)
        check_gpu_memory(spec.stages, free, f"{ctx.device} of machine {ctx.machine_name}")
    if any(st.device == "cuda" for st in spec.stages):
        try:
            dist.barrier()
        except RuntimeError as err:
            raise ctx.peer_error("waiting for every process's device check", [], err) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetrain.pipeline.worker")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    spec = RunSpec.load(args.spec)
    torch.set_num_threads(1)  # `threads: N` machines get N in init()
    ctx = init()
    if ctx.world_size != spec.world_size:
        raise SystemExit(f"the run spec needs {spec.world_size} processes, the launcher started {ctx.world_size}")
    # every rank creates every stage's group, in the same order
    groups = make_groups(ctx, [spec.stage_ranks(s) for s in range(len(spec.stages))],
                         [f"stage {s}" for s in range(len(spec.stages))])
    role = spec.role(ctx.rank)
    try:
        check_devices(spec, ctx, role)
    except UserError as err:
        print(f"hetrain: error: {err}", file=sys.stderr, flush=True)
        return 2
    model = spec.model.build()
    model.train()
    layout = ShardLayout([spec.model.rows] * spec.model.n_tables, spec.ps_shards)
    start = latest_complete(spec) if spec.resume else 0
    if start:
        print(f"resuming from the checkpoint of step {start}", flush=True)
    ready = lambda: setup_barrier(ctx, spec)  # noqa: E731
    if role.kind == "shard":
        info = run_shard(spec, ctx, role.index, layout, model, start, ready)
    else:
        info = run_stage(spec, ctx, role.index, role.replica, layout, model, groups[role.index], start, ready)
    info["rank"] = ctx.rank
    if spec.metrics_dir:
        Path(spec.metrics_dir).mkdir(parents=True, exist_ok=True)
        (Path(spec.metrics_dir) / f"rank{ctx.rank}.json").write_text(json.dumps(info))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
