"""One pipeline process: a stage replica or a sparse-PS shard, by rank.

Started by the single launcher (`hetrain train` calls it with ``-m
hetrain.pipeline.worker --spec run.json``). Stage replicas run synchronous pipelined
steps (GPipe order: forward every owned micro-batch, then backward), exchange
activations and their gradients with the neighbouring stages over gloo point-to-point,
pull/push embedding rows from the shards, and all-reduce dense gradients inside their
stage. Micro-batch i of a step goes to replica i mod k of a stage with k replicas, so
uneven replica counts between stages fan in and out deterministically.
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
from torch import nn

from ..comm import p2p
from ..runtime.context import init, shutdown
from ..train.checkpoint import load_checkpoint, save_checkpoint
from .data import CTRData, MicroBatchLoader
from .sparse_ps import ShardLayout, ShardState, SparseClient, serve
from .spec import RunSpec

HDR_LEN = 64
_DTYPES = {0: torch.float32, 1: torch.int64}
_CODES = {v: k for k, v in _DTYPES.items()}


# ------------------------------------------------------------------ tensors on the wire


def _tag(mb: int, i: int) -> int:
    """64 tags per micro-batch in the pipeline range of comm/p2p.py."""
    return p2p.PIPELINE(mb * 64 + i)


def send_tensors(ts: list[torch.Tensor], dst: int, mb: int, ready_at: float = 0.0) -> list:
    """isend a header (count, then dtype, ndim, dims per tensor; last slot: the emulated
    time the data is ready, in µs) and the tensors packed into one float32 and one int64
    buffer; returns (work, buffer) pairs the caller keeps until they complete."""
    h = [len(ts)]
    for t in ts:
        h += [_CODES[t.dtype], t.dim(), *t.shape]
    if len(h) > HDR_LEN - 1:
        raise ValueError(f"{len(ts)} tensors do not fit in one message header")
    hdr = torch.zeros(HDR_LEN, dtype=torch.int64)
    hdr[: len(h)] = torch.tensor(h)
    hdr[-1] = int(ready_at * 1e6)
    out = [(p2p.isend(hdr, dst, _tag(mb, 0)), hdr)]
    for code, dt in _DTYPES.items():
        part = [t for t in ts if t.dtype == dt]
        if part:
            flat = p2p.flatten(part, dtype=dt)
            out.append((p2p.isend(flat, dst, _tag(mb, 1 + code), what="sending activations"), flat))
    return out


def recv_tensors(src: int, mb: int) -> tuple[list[torch.Tensor], float]:
    """The tensors of one message, and the emulated time they are ready at."""
    hdr = torch.empty(HDR_LEN, dtype=torch.int64)
    p2p.recv(hdr, src, _tag(mb, 0))
    h = hdr.tolist()
    n, pos, metas = h[0], 1, []
    for _ in range(n):
        code, nd = h[pos], h[pos + 1]
        shape = h[pos + 2: pos + 2 + nd]
        pos += 2 + nd
        if code not in _DTYPES or nd < 0 or any(d < 0 for d in shape) or pos > HDR_LEN - 1:
            raise RuntimeError(f"malformed activation header from rank {src}")
        metas.append((code, shape))
    flats = {}
    for code, dt in _DTYPES.items():
        total = sum(int(torch.Size(sh).numel()) for c, sh in metas if c == code)
        if total:
            flats[code] = torch.empty(total, dtype=dt)
            p2p.recv(flats[code], src, _tag(mb, 1 + code))
    views = {code: iter(p2p.unflatten(flat, [sh for c, sh in metas if c == code])) for code, flat in flats.items()}
    out = [next(views[code]).clone() if code in views else torch.empty(shape, dtype=_DTYPES[code])
           for code, shape in metas]
    return out, h[-1] / 1e6


# ------------------------------------------------------------------ embedding layers


class PSEmbedding(nn.Module):
    """Stands in for `EmbeddingLookup` in the runtime: the table lives on the shards;
    ``rows`` (pulled for this micro-batch) and ``inv`` (each ID's index in it) are set
    before the stage runs."""

    def __init__(self, orig):
        super().__init__()
        self.index, self.last = orig.index, orig.last
        self.rows: torch.Tensor | None = None
        self.inv: torch.Tensor | None = None

    def forward(self, dense, ids, *pooled):
        v = nn.functional.embedding_bag(self.inv, self.rows, mode="sum")
        return (dense, *pooled, v) if self.last else (dense, ids, *pooled, v)


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


def run_shard(spec: RunSpec, ctx, j: int, layout: ShardLayout, model, start: int) -> dict:
    full = torch.cat([m.table.weight.detach() for m in model.layers if hasattr(m, "table")])
    state = ShardState(layout.shard_of(full, j), spec.optim)
    if start:
        state.load_state_dict(load_checkpoint(ckpt_path(spec, start, f"shard{j}")))
    clients = [r for s, st in enumerate(spec.stages) if _has_emb(model, st) for r in spec.stage_ranks(s)]

    def on_step(done: int) -> None:
        if want_ckpt(spec, done):
            save(spec, done, f"shard{j}", state.state_dict())
        _maybe_fail(spec, ctx.rank, done)

    steps = serve(state, clients, spec.model.dim, start_step=start, on_step=on_step, on_error=ctx.peer_error)
    return {"role": f"shard{j}", "rows": int(state.rows.shape[0]), "steps": steps}


def _has_emb(model, st) -> bool:
    return any(getattr(m, "table", None) is not None for m in model.layers[st.start: st.end])


def _maybe_fail(spec: RunSpec, rank: int, done: int) -> None:
    if rank == spec.fail_rank and done == spec.fail_step:
        print(f"fault injection: rank {rank} kills itself after step {done}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def run_stage(spec: RunSpec, ctx, s: int, r: int, layout: ShardLayout, model, groups, start: int) -> dict:
    st = spec.stages[s]
    k = st.instances
    last = s == len(spec.stages) - 1
    prev = spec.stage_ranks(s - 1) if s > 0 else []
    nxt = spec.stage_ranks(s + 1) if not last else []
    sizes = spec.mb_sizes()
    mine = [i for i in range(spec.micro_batches) if i % k == r]
    # the runtime's embedding layers pull from the shards
    embs = []
    for li in range(st.start, st.end):
        if hasattr(model.layers[li], "table"):
            model.layers[li] = PSEmbedding(model.layers[li])
            embs.append(li)
    layers = model.layers[st.start: st.end]
    params = [p for layer in layers for p in layer.parameters()]
    names = [f"{st.start + i}.{n}" for i, layer in enumerate(layers) for n, _ in layer.named_parameters()]
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
    client = SparseClient(layout, spec.shard_ranks, spec.model.dim, on_error=ctx.peer_error) if embs else None
    loader = MicroBatchLoader(CTRData(spec.data), spec.batch, sizes) if s == 0 else None
    pacer = Pacer(spec.emulate)
    T = st.time_per_sample_s
    group = groups[s]
    ends, losses = [], []
    trace = [] if os.environ.get("HETRAIN_TRACE") else None

    def ev(what: str) -> None:
        if trace is not None:
            trace.append((what, time.time()))
    prof = {"recv_wait_s": 0.0, "pull_s": 0.0, "step_end_s": 0.0}

    def fail(what, peers, err):
        return ctx.peer_error(what, peers, err)

    for step in range(start, spec.steps):
        saved, sends = {}, []
        pacer.busy_until = max(pacer.busy_until, time.time())  # waiting at a step boundary is idle time
        def receive(peer: int, i: int, what: str):
            """Tensors of micro-batch i from a neighbour stage; the wait counts as idle time."""
            tw = time.perf_counter()
            try:
                got, ready = recv_tensors(peer, i)
            except RuntimeError as err:  # gloo's error: name the neighbour that went away
                raise fail(f"receiving {what} of micro-batch {i}", [peer], err) from None
            pacer.begin(ready)
            prof["recv_wait_s"] += time.perf_counter() - tw
            return got

        step_loss = torch.zeros(())
        for i in mine:
            m = sizes[i]
            if s == 0:  # reading data: the next micro-batch is always ready
                pacer.begin(0.0)
                dense, ids, label = loader.get(step, i)
                inputs = [dense, ids]
            else:
                src = prev[i % len(prev)]
                got = receive(src, i, "activations")
                label, inputs = got[-1], got[:-1]
                for t in inputs:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            uniq = rows = None
            if embs:
                ids = inputs[1]
                keys = torch.stack([layout.keys(model.layers[li].index, ids[:, model.layers[li].index, :])
                                    for li in embs], 0)
                uniq, inv = torch.unique(keys, return_inverse=True)
                tp = time.perf_counter()
                rows = client.pull(uniq, step).requires_grad_(True)
                prof["pull_s"] += time.perf_counter() - tp
                for j, li in enumerate(embs):
                    model.layers[li].rows, model.layers[li].inv = rows, inv[j]
            ev(f"fwd{i}-in")
            out = list(model.run_range(st.start, st.end, *inputs))
            if last:
                loss = model.loss(out[0], label)
                step_loss += loss.detach() * m
                (loss * (m / spec.batch)).backward()
                _send_back(inputs, prev, i, sends, s, pacer.finish(m * T))
                if embs:
                    client.push(uniq, rows.grad, step)
                pacer.wait()
                ev(f"mb{i}-done")
            else:
                try:
                    sends += send_tensors(out + [label], nxt[i % len(nxt)], i, pacer.finish(m * T / 3))
                except RuntimeError as err:
                    raise fail(f"sending activations of micro-batch {i}", [nxt[i % len(nxt)]], err) from None
                saved[i] = (inputs, out, uniq, rows)
                pacer.wait()
                ev(f"fwd{i}-out")
        if not last:
            for i in mine:
                m = sizes[i]
                inputs, out, uniq, rows = saved.pop(i)
                dst = nxt[i % len(nxt)]
                grads = receive(dst, i, "gradients")
                ev(f"bwd{i}-in")
                fl = [o for o in out if o.is_floating_point()]
                pairs = [(o, g) for o, g in zip(fl, grads) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                end = pacer.finish(m * T * 2 / 3)
                if s > 0:
                    _send_back(inputs, prev, i, sends, s, end)
                if embs:
                    client.push(uniq, rows.grad, step)
                pacer.wait()
                ev(f"bwd{i}-out")
        te = time.perf_counter()
        try:
            p2p.wait_all([w for w, _ in sends], None, "sending to the neighbour stages")  # named below
            ev("sends-done")
            if client is not None:
                client.commit(step)
            ev("committed")
            pacer.begin(time.time())
            if params:
                if k > 1:
                    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                                      for p in params])
                    dist.all_reduce(flat, group=group)
                    off = 0
                    for p in params:
                        n = p.numel()
                        p.grad = flat[off: off + n].view_as(p).clone()
                        off += n
                    pacer.pad(st.allreduce_s)
                opt.step()
                opt.zero_grad(set_to_none=True)
        except RuntimeError as err:
            raise fail("finishing the step (gradients to peers)", [], err) from None
        prof["step_end_s"] += time.perf_counter() - te
        ends.append(time.time())
        ev("step-end")
        if last:
            losses.append(float(step_loss) / sum(sizes[i] for i in mine))
        done = step + 1
        if r == 0 and want_ckpt(spec, done):
            save(spec, done, f"stage{s}", {"params": {n: p.detach().clone() for n, p in zip(names, params)},
                                           "optim": opt.state_dict() if opt else {}})
        _maybe_fail(spec, ctx.rank, done)
    if client is not None:
        client.stop()
    return {"role": f"stage{s}/replica{r}", "type": st.type, "step_end_time": ends, "loss": losses,
            "real_s": pacer.real_s, "slept_s": pacer.slept_s, "over_target": pacer.over,
            "micro_batches": len(mine), "start_step": start, **prof, **({"trace": trace} if trace else {})}


def _send_back(inputs, prev, i, sends, s, ready_at: float) -> None:
    if s == 0:
        return
    g = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
    sends += send_tensors(g, prev[i % len(prev)], i, ready_at)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetrain.pipeline.worker")
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    spec = RunSpec.load(args.spec)
    torch.set_num_threads(1)
    ctx = init()
    if ctx.world_size != spec.world_size:
        raise SystemExit(f"the run spec needs {spec.world_size} processes, the launcher started {ctx.world_size}")
    # every rank creates every stage's group, in the same order
    groups = [dist.new_group(spec.stage_ranks(s)) for s in range(len(spec.stages))]
    role = spec.role(ctx.rank)
    model = spec.model.build()
    model.train()
    layout = ShardLayout([spec.model.rows] * spec.model.n_tables, spec.ps_shards)
    start = latest_complete(spec) if spec.resume else 0
    if start:
        print(f"resuming from the checkpoint of step {start}", flush=True)
    if role.kind == "shard":
        info = run_shard(spec, ctx, role.index, layout, model, start)
    else:
        info = run_stage(spec, ctx, role.index, role.replica, layout, model, groups, start)
    info["rank"] = ctx.rank
    if spec.metrics_dir:
        Path(spec.metrics_dir).mkdir(parents=True, exist_ok=True)
        (Path(spec.metrics_dir) / f"rank{ctx.rank}.json").write_text(json.dumps(info))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
