"""The data plane with CUDA tensors: staging overhead, overlap, and no host sync in backward.

Several worker processes share this host's one GPU (each worker machine of the cluster
file this script writes has `device.cuda: true`, all on node 0), so gradients travel the
staged gloo path: pinned host buffers, copy streams, CPU summation servers on the same
host (mode ps, two CPU machines). Each part is measured in the same launched processes:

(a) push_pull of the gradients of a GPT-2-small-sized transformer (124 M parameters):
    from CUDA tensors, from host tensors of the same shapes (the difference is the
    staging overhead), the pinned device->host + host->device copies of those bytes alone
    (the staging's physical bound), and PyTorch DDP on the gloo backend all-reducing the
    same CUDA tensors (the baseline);
(b) a training step of that transformer (synthetic tokens) with DistributedOptimizer,
    overlap off and on (a second launch with --overlap): exposed communication per step
    = step time - the same step's compute with a local optimizer and no exchange;
(c) backward with overlap on under torch.cuda.set_sync_debug_mode("error"): a host
    synchronisation inside a gradient hook would raise.

    PYTHONPATH=. python bench/gpu.py --json out.json [--quick]

Without CUDA it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pinned_pair import repo_env  # noqa: E402

MARK = "HETRAIN_GPU_BENCH "
MODEL = dict(vocab=50257, d=768, heads=12, depth=12, seq=256, n_classes=2)  # GPT-2 small: 124 M parameters


def _median_time(fn, repeats: int, barrier) -> tuple[float, list[float]]:
    import torch

    times = []
    for _ in range(repeats):
        barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def worker(phase: str, repeats: int, batch: int) -> None:
    """Runs inside every worker process of a launch."""
    import torch
    import torch.distributed as dist

    import hetrain
    from hetrain.models.transformer import TransformerModel

    ctx = hetrain.init()
    dev = hetrain.device()
    barrier = lambda: dist.barrier(group=ctx.worker_group)  # noqa: E731
    torch.manual_seed(0)
    model = TransformerModel(**MODEL).to(dev)
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    out: dict = {"params": numel, "workers": hetrain.size(), "device": torch.cuda.get_device_name(dev)}
    if phase == "pushpull":
        out["push_pull"] = _pushpull_phase(ctx, dev, named, repeats, barrier)
    else:  # "train": phase run once without and once with --overlap
        key = "overlap_on" if ctx.comm.overlap else "overlap_off"
        out["train"] = {key: _train_phase(ctx, dev, model, batch, repeats, barrier)}
    if hetrain.rank() == 0:
        print(MARK + json.dumps(out), flush=True)
    hetrain.shutdown()


def _pushpull_phase(ctx, dev, named, repeats: int, barrier) -> dict:
    """hetrain's push_pull of the model's gradients, from CUDA and from host tensors,
    beside a pinned round-trip copy of them and PyTorch DDP's all-reduce of the same
    shapes (gloo backend, CUDA tensors)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetrain

    numel = sum(p.numel() for _, p in named)
    grads = [(n, torch.randn_like(p)) for n, p in named]
    host = [(n, g.cpu()) for n, g in grads]
    hetrain.push_pull(grads)  # warm-up: layout, pinned buffers, connections
    hetrain.push_pull(host)
    cuda_s, cuda_all = _median_time(lambda: hetrain.push_pull(grads), repeats, barrier)
    host_s, host_all = _median_time(lambda: hetrain.push_pull(host), repeats, barrier)
    flat = torch.cat([g.reshape(-1) for _, g in grads])
    pinned = torch.empty(flat.numel(), pin_memory=True)

    def copies():
        pinned.copy_(flat, non_blocking=True)
        flat.copy_(pinned, non_blocking=True)

    copies()
    copy_s, _ = _median_time(copies, repeats, barrier)
    del flat, pinned

    class ParamBag(torch.nn.Module):
        """Parameters of the model's shapes; backward fills every gradient at once, so
        the time is DDP's all-reduce of them (the compute is a few fill kernels)."""

        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(p)) for _, p in named])

        def forward(self, x):
            return x * sum(p.sum() for p in self.ps)

    bag = ParamBag().to(dev)
    x = torch.ones((), device=dev)
    local_s, _ = _median_time(lambda: bag(x).backward(), repeats, barrier)
    ddp = DDP(bag, device_ids=[dev], process_group=ctx.worker_group, gradient_as_bucket_view=True)
    ddp(x).backward()  # warm-up (and DDP's bucket rebuild)
    ddp_s, ddp_all = _median_time(lambda: ddp(x).backward(), repeats, barrier)
    return {"params": numel, "bytes": numel * 4, "cuda_s": cuda_s, "host_s": host_s, "copy_s": copy_s,
            "ddp_s": ddp_s, "ddp_local_backward_s": local_s, "cuda_all": cuda_all, "host_all": host_all,
            "ddp_all": ddp_all}


def _train_phase(ctx, dev, model, batch: int, repeats: int, barrier) -> dict:
    """A training step with hetrain's DistributedOptimizer against the same step's compute
    alone; with overlap on, one more backward under CUDA's sync-debug checker (no host
    synchronisation may happen inside it)."""
    import torch

    import hetrain

    g = torch.Generator(device="cpu").manual_seed(hetrain.rank())
    ids = torch.randint(0, MODEL["vocab"], (batch, MODEL["seq"]), generator=g).to(dev)
    target = torch.randint(0, MODEL["n_classes"], (batch,), generator=g).to(dev)
    local = torch.optim.SGD(model.parameters(), lr=1e-4)

    def compute_step():
        local.zero_grad()
        model.loss(model(ids), target).backward()
        local.step()

    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters())

    def train_step():
        opt.zero_grad()
        opt.set_batch_size(batch)
        model.loss(model(ids), target).backward()
        opt.step()

    compute_step()
    train_step()  # warm-up: layout, pinned buffers
    compute_s, _ = _median_time(compute_step, repeats, barrier)
    step_s, step_all = _median_time(train_step, repeats, barrier)
    res = {"step_s": step_s, "compute_s": compute_s, "exposed_s": max(0.0, step_s - compute_s),
           "step_all": step_all}
    if ctx.comm.overlap:  # (c) one more step, backward under the sync-debug checker
        opt.zero_grad()
        opt.set_batch_size(batch)
        loss = model.loss(model(ids), target)
        ok = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        except RuntimeError as err:
            ok = False
            res["sync_error"] = str(err).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.step()
        res["no_host_sync_in_backward"] = ok
    return res


def cluster_file(tmp: Path, workers: int, cpus: int) -> Path:
    machines = [{"name": f"g{i}", "role": "worker", "device": {"kind": "gpu", "cuda": True, "memory": "16GiB"}}
                for i in range(workers)]
    machines += [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)]
    path = tmp / "gpu.yaml"
    path.write_text(yaml.safe_dump({"name": "one-gpu", "machines": machines}))
    return path


def launch(cfile: Path, phase: str, repeats: int, batch: int, overlap: bool, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "ps", "--timeout", "120",
           "--run-dir", str(cfile.parent / f"run-{phase}-{int(overlap)}")] + (["--overlap"] if overlap else []) + [
           str(Path(__file__).resolve()), "--worker", phase, "--repeats", str(repeats), "--batch", str(batch)]
    env = repo_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    raise RuntimeError(f"{phase} (overlap={overlap}) failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    ap.add_argument("--workers", type=int, default=2, help="worker processes sharing the GPU")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 256 tokens per worker and step")
    ap.add_argument("--worker", choices=["pushpull", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.repeats, args.batch)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); nothing to measure")
        return 0
    repeats = 3 if args.quick else args.repeats
    t_start = time.time()
    from tqdm import tqdm

    runs = [("pushpull", False, 300), ("train", False, 200), ("train", True, 200)]
    with tempfile.TemporaryDirectory() as tmpd:
        cfile = cluster_file(Path(tmpd), args.workers, 2)
        pp, off, on = (launch(cfile, phase, repeats, args.batch, overlap, limit)
                       for phase, overlap, limit in tqdm(runs, desc="launches", file=sys.stderr))
    a = pp["push_pull"]
    train = {**off["train"], **on["train"]}
    no_sync = bool(train["overlap_on"].get("no_host_sync_in_backward"))
    gb = a["bytes"] / 1e9
    print(f"\n{pp['workers']} worker processes sharing one {pp['device']}, mode ps (2 CPU summation servers on "
          f"this host); GPT-2-small-sized transformer, {a['params'] / 1e6:.1f} M parameters ({gb:.2f} GB fp32); "
          f"medians of {repeats}")
    head = f"{'(a) push_pull of all gradients':<44}{'s':>9}{'GB/s':>8}{'vs host':>9}"
    print(head + "\n" + "-" * len(head))
    rows = [("from CUDA tensors (staged)", a["cuda_s"]), ("from host tensors (same shapes)", a["host_s"]),
            ("pinned D2H + H2D copies alone", a["copy_s"]), ("PyTorch DDP, gloo, same CUDA tensors", a["ddp_s"])]
    for name, s in rows:
        print(f"{name:<44}{s:>9.3f}{gb / s:>8.2f}{s / a['host_s']:>9.2f}")
    print(f"CUDA / host = {a['cuda_s'] / a['host_s']:.3f} (target <= 1.15, goal 1.05); "
          f"CUDA / DDP = {a['cuda_s'] / a['ddp_s']:.3f} (target <= 1.0)")
    head = f"{'(b) training step, batch ' + str(args.batch) + 'x256 tokens/worker':<44}{'step s':>9}{'compute s':>11}{'exposed s':>11}"
    print("\n" + head + "\n" + "-" * len(head))
    for key in ("overlap_off", "overlap_on"):
        r = train[key]
        print(f"{key.replace('_', ' '):<44}{r['step_s']:>9.3f}{r['compute_s']:>11.3f}{r['exposed_s']:>11.3f}")
    print(f"\n(c) no host sync in backward with overlap on: {no_sync}"
          + (f" ({train['overlap_on'].get('sync_error')})" if not no_sync else ""))
    print(f"(wall {time.time() - t_start:.0f} s)")
    if args.json:
        result = {"push_pull": {k: a[k] for k in ("params", "bytes", "cuda_s", "host_s", "copy_s", "ddp_s",
                                                   "ddp_local_backward_s", "cuda_all", "host_all", "ddp_all")},
                  "no_host_sync_in_backward": no_sync, "train": train, "workers": pp["workers"],
                  "device": pp["device"], "repeats": repeats, "model": MODEL}
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
