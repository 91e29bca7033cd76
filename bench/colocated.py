"""All-reduce among processes on this host: hetrain's shared-memory data plane
(hetrain/comm/shm/) beside torch.distributed's all-reduce on gloo (TCP loopback), in
the same processes of the same run, and the memcpy bound of each shared-memory algorithm.

Three ways, each all-reducing an N-byte fp32 bucket in place:
- `shm_s`: the engine's way for host tensors: the bucket lives in the process's segment
  (comm/shm/arena.py; backward writes the gradients there), summed where it lies;
- `shm_copy_s`: a tensor the caller owns, copied into the segment and back in rounds
  (comm/shm/group.py; the way for buffers the transport did not allocate);
- `gloo_s`: torch.distributed's all-reduce on gloo, on the caller's tensor (how the
  engine's in-place staging all-reduces host buckets without shared memory).

memcpy_bound_s = (1.5 - 0.5/n) · N / S · n / min(n, cores) for the arena, and
memcpy_bound_copy_s = (2.5 + 0.5/n) · N / S · n / min(n, cores) with the copies, where n
is the processes, S the memcpy speed measured here (`perf.comm.memcpy_speed`: one thread)
and `cores` the CPUs this process may run on. Why: a memcpy of B bytes reads and writes
2B. In the arena a process reads N and writes N/n to sum its slice, and reads and writes
(n-1)N/n to push the sum into the others' segments: 3N - N/n. With the copies it reads
and writes 5N + N/n (copy in 2N; sum of its slice N + N/n; its slice back into its
segment 2N/n; gather of the other slices 2N(n-1)/n). With more processes than cores they
share them.

Beside the wall times, the CPU seconds each all-reduce took in all processes together
(`time.process_time`, every thread: gloo's I/O threads too): the work each way needs,
which a loaded host does not change as much as it changes wall time.

Used by bench/comm.py (its `colocated` section); alone:

    python bench/colocated.py --procs 2,4 --mb 4,100 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetrain.perf.comm import memcpy_speed, shm_allreduce_time  # noqa: E402


def memcpy_bound(nbytes: int, n: int, speed: float, cores: int, copies: bool = False) -> float:
    """The arena's bound is the cost model's price of the shared-memory all-reduce
    (`perf.comm.shm_allreduce_time`); with the copies in and out, (2.5 + 0.5/n)·N/S."""
    if not copies:
        return shm_allreduce_time(nbytes, n, speed, cores)
    return (2.5 + 0.5 / n) * nbytes / speed * n / min(n, cores)


def _timed(ops: list, repeats: int) -> list[list[float]]:
    """Per op and repeat: this process's time from a common start (a barrier) to the op's
    end, then per op and repeat the CPU time the process spent in it. The ops take turns
    within each repeat (A B A B ...), so a host whose load drifts slows them alike."""
    for op in ops:
        op()  # warm-up: first touch of the pages, gloo's buffers
    out: list[list[float]] = [[] for _ in ops]
    cpu: list[list[float]] = [[] for _ in ops]
    for _ in range(repeats):
        for k, op in enumerate(ops):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            op()
            out[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)  # every thread of the process (gloo's too)
    return out + cpu


def _member(rank: int, n: int, path: str, sizes: list[int], repeats: int, out) -> None:
    from hetrain.comm.shm.arena import ArenaGroup, arena_bytes
    from hetrain.comm.shm.group import HostGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    job, secret = f"bench{os.getppid()}", "bench-secret-0123456789abcdef"
    group = HostGroup(job, secret, f"n{n}", list(range(n)), rank, dist.barrier)
    numel = max(sizes) // 4
    arena = ArenaGroup(job_id=job, secret=secret, key=f"a{n}", ranks=list(range(n)), rank=rank,
                       barrier=dist.barrier, capacity=arena_bytes([numel]))
    bucket = arena.alloc(numel)
    res = {}
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        xa = bucket[:nbytes // 4]
        xa.copy_(x)
        times = _timed([lambda: arena.all_reduce(xa), lambda: group.all_reduce(x), lambda: dist.all_reduce(x)],
                       repeats)
        # each repeat's time is the slowest process's; its CPU time, all processes' together
        t = torch.tensor(times[:3], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        c = torch.tensor(times[3:], dtype=torch.float64)
        dist.all_reduce(c)
        med = [statistics.median(r) for r in t.tolist()] + [statistics.median(r) for r in c.tolist()]
        res[nbytes] = dict(zip(["shm_s", "shm_copy_s", "gloo_s", "shm_cpu_s", "shm_copy_cpu_s", "gloo_cpu_s"], med))
        del x, xa
    del bucket
    arena.close()
    group.close()
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def run(procs: list[int], sizes: list[int], repeats: int) -> list[dict]:
    """One case per (processes, size): shm_s, shm_copy_s, gloo_s and their memcpy bounds."""
    speed = memcpy_speed(100_000_000, 5)  # the cost model's measurement: one thread's copies
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cases = []
    ctx = mp.get_context("spawn")
    for n in procs:
        with tempfile.TemporaryDirectory() as tmp:
            q = ctx.Queue()
            ps = [ctx.Process(target=_member, args=(r, n, f"{tmp}/pg", sizes, repeats, q)) for r in range(n)]
            for p in ps:
                p.start()
            res = q.get(timeout=600)
            for p in ps:
                p.join(120)
        for nbytes in sizes:
            r = res[nbytes]
            cases.append({"procs": n, "bytes": nbytes, **r,
                          "memcpy_bound_s": memcpy_bound(nbytes, n, speed, cores),
                          "memcpy_bound_copy_s": memcpy_bound(nbytes, n, speed, cores, copies=True),
                          "gloo_over_shm": r["gloo_s"] / r["shm_s"],
                          "gloo_over_shm_copy": r["gloo_s"] / r["shm_copy_s"]})
    return [dict(c, memcpy_Bps=speed, cores=cores, repeats=repeats) for c in cases]


def table(cases: list[dict]) -> str:
    head = (f"{'procs':>5}{'MB':>5}{'shm s':>9}{'gloo s':>9}{'gloo/shm':>9}{'shm/bound':>10}"
            f"{'copy s':>9}{'gloo/copy':>10}{'copy/bound':>11}{'cpu gloo/shm':>13}")
    rows = [head, "-" * len(head)]
    for c in cases:
        rows.append(f"{c['procs']:>5}{c['bytes'] / 1e6:>5.0f}{c['shm_s']:>9.4f}{c['gloo_s']:>9.4f}"
                    f"{c['gloo_over_shm']:>9.2f}{c['shm_s'] / c['memcpy_bound_s']:>10.2f}"
                    f"{c['shm_copy_s']:>9.4f}{c['gloo_over_shm_copy']:>10.2f}"
                    f"{c['shm_copy_s'] / c['memcpy_bound_copy_s']:>11.2f}{c['gloo_cpu_s'] / c['shm_cpu_s']:>13.2f}")
    c = cases[0]
    rows.append(f"(medians of {c['repeats']}, the three taking turns, each the slowest process's; shm: buckets in the "
                f"segments (the engine's), copy: a caller's tensor copied in and out; memcpy {c['memcpy_Bps'] / 1e9:.2f} "
                f"GB/s on one thread; {c['cores']} cores; bounds (1.5 - 0.5/n)·N/S and (2.5 + 0.5/n)·N/S, "
                "times n/min(n, cores))")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--mb", default="4,100")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    cases = run([int(p) for p in args.procs.split(",")], [int(float(m) * 1e6) for m in args.mb.split(",")],
                args.repeats)
    print(table(cases))
    if args.json:
        Path(args.json).write_text(json.dumps({"colocated": cases}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
