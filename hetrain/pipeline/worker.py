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
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import p2p
from ..comm.engine import PushPull
from ..comm.group import make_groups
from ..errors import UserError
from ..runtime.context import PeerLostError, init, shutdown
from ..train.checkpoint import load_checkpoint
from .data import CTRData, MicroBatchLoader
from .devicemap import check_gpu_memory
from .messages import recv_tensors, send_tensors, wire_for
from .sparse_ps import ShardLayout, ShardState, SparseClient, serve
from .spec import RunSpec
from .checkpoints import ckpt_path, latest_complete, save, want_ckpt
from .pacer import Pacer
from .stage import StageCompute


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
    served = threading.Event()
    threading.Thread(target=_exit_when_a_peer_is_lost, args=(ctx, served), daemon=True,
                     name="shard-peer-watch").start()
    try:
        steps = serve(state, clients, spec.model.dim, start_step=start, on_step=on_step, on_error=ctx.peer_error)
    finally:
        served.set()
    return {"role": f"shard{j}", "rows": int(state.rows.shape[0]), "steps": steps}


def _exit_when_a_peer_is_lost(ctx, served: threading.Event, poll_s: float = 0.5) -> None:
    """A shard waits for its next request with a receive from any client, which a
    client's death does not break: the shard would sit there until the launcher's grace
    after a failure (--timeout + 5 s) ran out and it was killed, and the failed job
    would end that much later. So once the launcher has recorded a lost peer, the shard
    names it and exits at once (its checkpoints are written atomically)."""
    while not served.wait(poll_s):
        dead = ctx.lost_peers(wait_s=0)
        if dead:
            err = ctx.peer_error("waiting for requests", sorted(dead), RuntimeError("a peer of this round was lost"))
            print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
            os._exit(1)


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
    """Train replica `r` of stage `s` from step `start` to the end; returns its report."""
    return _StageRunner(spec, ctx, s, r, layout, model, group, start).run(ready)


class _StageRunner:
    """One stage replica's synchronous pipelined training (GPipe order).

    A class so that each part of a step can be read on its own: setup and checkpoint
    restore (`__init__`), the forward pass over this replica's micro-batches (`_forward`),
    the backward pass of a stage that is not the last (`_backward`), and the step's end
    (`_finish_step`: outstanding sends, embedding commit, the replicas' gradient average,
    the optimizer, checkpoints). Neighbour traffic goes through `_receive`/`_send`, which
    name the peer that went away when gloo fails.
    """

    def __init__(self, spec: RunSpec, ctx, s: int, r: int, layout: ShardLayout, model, group, start: int) -> None:
        self.spec, self.ctx, self.s, self.r, self.model, self.start = spec, ctx, s, r, model, start
        self.st = st = spec.stages[s]
        k = st.instances
        self.last = s == len(spec.stages) - 1
        self.prev = spec.stage_ranks(s - 1) if s > 0 else []
        self.nxt = spec.stage_ranks(s + 1) if not self.last else []
        self.sizes = sizes = spec.mb_sizes()
        self.mine = [i for i in range(spec.micro_batches) if i % k == r]
        self.own = sum(sizes[i] for i in self.mine)  # this replica's samples per step (its push_pull weight)
        self.wire = wire_for(ctx.device, ctx.describe(ctx.rank))
        self.client = SparseClient(layout, spec.shard_ranks, spec.model.dim, on_error=ctx.peer_error)
        self.stage = StageCompute(model, st.start, st.end, layout, self.wire, self.client)
        self.params, self.names = self.stage.params, self.stage.names
        self.opt = None
        if self.params:
            self.opt = (torch.optim.Adagrad(self.params, lr=spec.optim.lr, eps=spec.optim.eps)
                        if spec.optim.kind == "adagrad" else torch.optim.SGD(self.params, lr=spec.optim.lr))
        if start:
            self._restore(start)
        # dense gradients: the batch-weighted average over the stage's replicas, on its group
        self.engine = PushPull(ctx, group) if self.params and k > 1 else None
        self.loader = MicroBatchLoader(CTRData(spec.data), spec.batch, sizes, k) if s == 0 else None
        self.pacer = Pacer(spec.emulate)
        self.T = st.time_per_sample_s
        self.ends, self.losses = [], []
        self.trace = [] if os.environ.get("HETRAIN_TRACE") else None
        self.prof = {"recv_wait_s": 0.0, "step_end_s": 0.0}

    def _restore(self, start: int) -> None:
        ck = load_checkpoint(ckpt_path(self.spec, start, f"stage{self.s}"))
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(ck["params"][n])
        if self.opt is not None:
            self.opt.load_state_dict(ck["optim"])

    def ev(self, what: str) -> None:
        if self.trace is not None:
            self.trace.append((what, time.time()))

    def _receive(self, peer: int, i: int, what: str):
        """Tensors of micro-batch i from a neighbour stage; the wait counts as idle time."""
        got, ready = self._receive_early(peer, i, what)
        self.pacer.begin(ready)
        return got

    def _receive_early(self, peer: int, i: int, what: str):
        """(tensors of micro-batch i, the time the sender had them ready), the device clock
        left alone (a micro-batch taken ahead of the one being computed)."""
        tw = time.perf_counter()
        try:
            got, ready = recv_tensors(peer, i, self.wire)
        except PeerLostError:
            raise
        except RuntimeError as err:  # gloo's error: name the neighbour that went away
            raise self.ctx.peer_error(f"receiving {what} of micro-batch {i}", [peer], err) from None
        self.prof["recv_wait_s"] += time.perf_counter() - tw
        return got, ready

    def _take(self, step: int, i: int):
        """A later stage with lookups: micro-batch i's activations, taken as soon as they
        come, and its rows' pull posted (as the first stage posts its own ahead)."""
        got, ready = self._receive_early(self.prev[i % len(self.prev)], i, "activations")
        return got, ready, self.stage.prepare(got[:-1], step)

    def _send(self, ts, dst: int, i: int, ready_at: float, what: str) -> list:
        try:
            return send_tensors(ts, dst, i, ready_at, self.wire)
        except PeerLostError:
            raise
        except RuntimeError as err:
            raise self.ctx.peer_error(f"sending {what} of micro-batch {i}", [dst], err) from None

    def _send_back(self, inputs, i: int, ready_at: float) -> list:
        if self.s == 0:
            return []
        g = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
        return self._send(g, self.prev[i % len(self.prev)], i, ready_at, "input gradients")

    def _read(self, step: int, i: int):
        dense, ids, label = (self.wire.from_cpu(t) for t in self.loader.get(step, i))
        inputs = [dense, ids]
        return inputs, label, self.stage.prepare(inputs, step)

    def _forward(self, step: int, sends: list) -> tuple[dict, torch.Tensor]:
        """Forward every owned micro-batch (the last stage also runs its backward at once);
        returns what the backward pass needs and the step's summed loss."""
        pacer, sizes, mine = self.pacer, self.sizes, self.mine
        saved = {}
        step_loss = torch.zeros((), device=self.wire.device)
        ahead: dict = {}  # the next micro-batches, read or received, and their rows' pulls posted
        for n_i, i in enumerate(mine):
            m = sizes[i]
            prepared = None
            if self.s == 0:  # reading data: the next micro-batch is always ready
                pacer.begin(0.0)
                inputs, label, prepared = ahead.pop(i) if i in ahead else self._read(step, i)
                for j in mine[n_i + 1: n_i + 1 + PULL_AHEAD]:  # their rows arrive while this one computes
                    if j not in ahead:
                        ahead[j] = self._read(step, j)
            elif self.stage.embs and not self.spec.emulate:
                # a later stage with lookups on real devices: the next micro-batches' activations
                # are taken as they arrive and their rows pulled while this one computes (the pull
                # otherwise waits in line, after the activations). Emulated runs keep one
                # at a time, as their device clocks assume.
                got, ready, prepared = ahead.pop(i) if i in ahead else self._take(step, i)
                self.pacer.begin(ready)
                for j in mine[n_i + 1: n_i + 1 + PULL_AHEAD]:
                    if j not in ahead:
                        ahead[j] = self._take(step, j)
                label, inputs = got[-1], got[:-1]
                for t in inputs:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            else:
                got = self._receive(self.prev[i % len(self.prev)], i, "activations")
                label, inputs = got[-1], got[:-1]
                for t in inputs:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            self.ev(f"fwd{i}-in")
            out, pulled = self.stage.forward(inputs, step, prepared)
            if self.last:
                loss = self.model.loss(out[0], label)
                step_loss += loss.detach() * m
                (loss * (m / self.spec.batch)).backward()
                sends += self._send_back(inputs, i, pacer.finish(m * self.T))
                self.stage.push(pulled, step)
                pacer.wait()
                self.ev(f"mb{i}-done")
            else:
                sends += self._send(out + [label], self.nxt[i % len(self.nxt)], i, pacer.finish(m * self.T / 3),
                                    "activations")
                saved[i] = (inputs, out, pulled)
                pacer.wait()
                self.ev(f"fwd{i}-out")
        return saved, step_loss

    def _backward(self, step: int, saved: dict, sends: list) -> None:
        """Backward every owned micro-batch with the gradients the next stage sends back."""
        for i in self.mine:
            m = self.sizes[i]
            inputs, out, pulled = saved.pop(i)
            grads = self._receive(self.nxt[i % len(self.nxt)], i, "gradients")
            self.ev(f"bwd{i}-in")
            fl = [o for o in out if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(fl, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            end = self.pacer.finish(m * self.T * 2 / 3)
            sends += self._send_back(inputs, i, end)
            self.stage.push(pulled, step)
            self.pacer.wait()
            self.ev(f"bwd{i}-out")

    def _average_gradients(self) -> None:
        named = []
        for n, p in zip(self.names, self.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            named.append((n, p.grad))
        # each replica hands over the mean gradient of its own samples (the last stage
        # scaled each micro-batch's loss by m/B); weighted by its sample count, the
        # average over the replicas is the gradient of the whole global batch
        if self.own != self.spec.batch:
            torch._foreach_mul_([g for _, g in named], self.spec.batch / self.own)
        self.engine.push_pull(named, weight=self.own)
        self.pacer.pad(self.st.allreduce_s)

    def _finish_step(self, step: int, sends: list, step_loss: torch.Tensor) -> None:
        """The step's end: outstanding sends, embedding commit, the replicas' gradient
        average and the optimizer step; then the loss, a checkpoint when due."""
        te = time.perf_counter()
        try:
            p2p.wait_all([w for w, _ in sends], None, "sending to the neighbour stages")  # named below
            self.ev("sends-done")
            if self.stage.embs:
                self.client.commit(step)
            self.ev("committed")
            self.pacer.begin(time.time())
            if self.params:
                if self.engine is not None:
                    self._average_gradients()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        except PeerLostError:
            raise
        except RuntimeError as err:
            raise self.ctx.peer_error("finishing the step (gradients to peers)", [], err) from None
        self.prof["step_end_s"] += time.perf_counter() - te
        self.ends.append(time.time())
        self.ev("step-end")
        if self.last:
            self.losses.append(float(step_loss) / self.own)
        done = step + 1
        if self.r == 0 and want_ckpt(self.spec, done):
            save(self.spec, done, f"stage{self.s}",
                 {"params": {n: p.detach().cpu().clone() for n, p in zip(self.names, self.params)},
                  "optim": _cpu(self.opt.state_dict()) if self.opt else {}})
        _maybe_fail(self.spec, self.ctx.rank, done)

    def run(self, ready) -> dict:
        if self.s == 0:
            self.loader.get(self.start, self.mine[0])  # its first chunk of data, before the clocks start
        ready()
        for step in range(self.start, self.spec.steps):
            sends: list = []
            self.pacer.busy_until = max(self.pacer.busy_until, time.time())  # waiting at a step boundary is idle time
            saved, step_loss = self._forward(step, sends)
            if not self.last:
                self._backward(step, saved, sends)
            self._finish_step(step, sends, step_loss)
        if self.stage.embs:
            self.client.stop()
        pacer, engine, trace = self.pacer, self.engine, self.trace
        return {"role": f"stage{self.s}/replica{self.r}", "type": self.st.type, "device": str(self.wire.device),
                "step_end_time": self.ends, "loss": self.losses, "real_s": pacer.real_s, "slept_s": pacer.slept_s,
                "over_target": pacer.over, "micro_batches": len(self.mine), "start_step": self.start,
                "comm_s": engine.stats.comm_s if engine else 0.0, "pull_s": self.stage.pull_s, **self.prof,
                **({"trace": trace} if trace else {})}


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
