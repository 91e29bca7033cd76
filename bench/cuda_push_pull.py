"""push_pull of a CUDA tensor beside co-located CPU workers, against the pinned copies alone
(GPU only).

One GPU worker (a 100M-parameter fp32 tensor on its GPU) and `--cpus` CPU workers on the
same host all-reduce it (`hetrain launch --mode allreduce`): the transport takes the
shared-memory path (hetrain/comm/shm/), the GPU's bytes copied straight into its pinned
segment and the sums straight back. In the same run the GPU worker times torch's pinned
copies of the same bytes (device->host into a pinned buffer, then host->device).

    push_pull_gbps   = bytes / (median push_pull time)
    pinned_copy_gbps = bytes / (median of device->host + host->device copy time)
    ratio            = push_pull_gbps / pinned_copy_gbps          (bar: >= 0.5)

    python bench/cuda_push_pull.py --json out.json        # < 2 min on a 16-core GPU host
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gpu import _median_time  # noqa: E402  (bench/gpu.py: one timing loop for the GPU benches)
from pinned_pair import repo_env  # noqa: E402

MARK = "HETRAIN_CUDA_PP "


def _median(fn, repeats: int, barrier) -> float:
    fn()  # warm-up: segments, pinned pages, buckets
    return _median_time(fn, repeats, barrier)[0]


def worker(params: int, repeats: int) -> None:
    """Runs in every worker of the launch; the GPU worker (rank 0) prints the results."""
    import torch
    import torch.distributed as dist

    import hetrain

    ctx = hetrain.init()
    dev = hetrain.device()
    cuda = dev.type == "cuda"
    t = torch.randn(params, device=dev) if cuda else torch.randn(params)
    barrier = lambda: dist.barrier(group=ctx.worker_group)  # noqa: E731
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    hetrain.push_pull([("p", t)])  # warm-up
    for _ in range(repeats):
        barrier()
        sync()
        t0 = time.perf_counter()
        hetrain.push_pull([("p", t)])
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        pinned = torch.empty(params, pin_memory=True)
        copy_s = _median(lambda: (pinned.copy_(t, non_blocking=True), t.copy_(pinned, non_blocking=True)),
                         repeats, lambda: None)
        pp_s = statistics.median(times)
        nbytes = params * 4
        collective = type(hetrain.engine().transport.collective).__name__
        print(MARK + json.dumps({"params": params, "bytes": nbytes, "push_pull_s": pp_s, "pinned_copy_s": copy_s,
                                 "push_pull_gbps": nbytes / pp_s / 1e9, "pinned_copy_gbps": nbytes / copy_s / 1e9,
                                 "ratio": copy_s / pp_s, "workers": hetrain.size(), "collective": collective,
                                 "device": torch.cuda.get_device_name(dev), "push_pull_all_s": times}), flush=True)
    hetrain.shutdown()


def cluster_file(tmp: Path, cpus: int, gpu_threads: int, cpu_threads: int) -> Path:
    machines = [{"name": "g0", "role": "worker", "device": {"kind": "gpu", "cuda": True}, "threads": gpu_threads}]
    machines += [{"name": f"c{j}", "role": "worker", "device": {}, "threads": cpu_threads} for j in range(cpus)]
    path = tmp / "cuda_push_pull.yaml"
    path.write_text(yaml.safe_dump({"name": "gpu-and-cpus", "machines": machines}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--params", type=int, default=100_000_000, help="fp32 parameters pushed and pulled")
    ap.add_argument("--cpus", type=int, default=2, help="co-located CPU worker processes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.params, args.repeats)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench/cuda_push_pull.py needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}); run it on a GPU host", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0))
    cpu_threads = max(1, cores // (2 * (args.cpus + 1)))  # half the cores for the workers' compute threads
    gpu_threads = max(1, cores // 2 - cpu_threads * args.cpus)
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmpd:
        cfile = cluster_file(Path(tmpd), args.cpus, gpu_threads, cpu_threads)
        cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "allreduce",
               "--timeout", "60", "--run-dir", str(Path(tmpd) / "run"), str(Path(__file__).resolve()), "--worker",
               "--params", str(args.params), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=repo_env())
    res = next((json.loads(line.split(MARK, 1)[1]) for line in proc.stdout.splitlines() if MARK in line), None)
    if res is None:
        print(f"the launch failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}",
              file=sys.stderr)
        return 1
    res.update(cpus=args.cpus, gpu_threads=gpu_threads, cpu_threads=cpu_threads, repeats=args.repeats,
               wall_s=time.time() - t_start)
    print(f"\npush_pull of {args.params / 1e6:.0f}M fp32 parameters from {res['device']} with {args.cpus} co-located "
          f"CPU workers ({res['collective']}); medians of {args.repeats}")
    head = f"{'':<34}{'seconds':>10}{'GB/s':>8}"
    print(head + "\n" + "-" * len(head))
    print(f"{'push_pull (all-reduce, CUDA)':<34}{res['push_pull_s']:>10.4f}{res['push_pull_gbps']:>8.2f}")
    print(f"{'pinned copies D2H + H2D alone':<34}{res['pinned_copy_s']:>10.4f}{res['pinned_copy_gbps']:>8.2f}")
    print(f"ratio push_pull / pinned copies = {res['ratio']:.3f} (bar >= 0.5); wall {res['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
