"""push_pull time of every communication mode on an emulated cluster with shaped links,
beside PyTorch DDP (gloo all-reduce) on the same cluster and the BytePS optimum t_opt.

n = 4 worker machines, k ∈ {0,1,2,4} CPU machines, each machine in its own network
namespace with a tc-shaped NIC (needs root; see docs/architecture.md). Each case is a
real `hetrain launch`; rank 0 reports the median of the repeats.

    python bench/comm.py --quick --json out.json

The `colocated` section (bench/colocated.py) runs first: 2 and 4 processes on this host,
4 MB and 100 MB, hetrain's shared-memory all-reduce beside gloo's in the same processes,
and the memcpy bound (no namespaces needed; `--sections colocated` runs it alone).
The `server_link` section (bench/server_link.py) then times push_pull of 2 workers and a
summation server on this host, 4 MB and 100 MB, partitions through shared memory beside
gloo over loopback (`--server-link auto` vs `gloo`; `--sections server_link` alone).
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
from hetrain.perf.comm import byteps_speedup_over_allreduce, byteps_time, ps_time, ring_allreduce_time  # noqa: E402
from pinned_pair import repo_env  # noqa: E402

MARK = "HETRAIN_BENCH "
MTU = 9000  # default --mtu: jumbo frames; at 1500 B, TCP/IP headers alone take ~5% of every link


def worker(sizes: list[int], repeats: int, ddp: bool) -> None:
    """Runs inside every worker process of one launched case."""
    import torch
    import torch.distributed as dist

    import hetrain

    ctx = hetrain.init()
    out = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4)
        hetrain.push_pull([("g", t)])  # warm-up: layout exchange, connections
        times = []
        for _ in range(repeats):
            dist.barrier(group=ctx.worker_group)
            t0 = time.perf_counter()
            hetrain.push_pull([("g", t)])
            times.append(time.perf_counter() - t0)
        out[str(nbytes)] = {"push_pull": statistics.median(times), "all": times}
        if ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = torch.nn.Linear(nbytes // 4, 1, bias=False)
            net = DDP(model, process_group=ctx.worker_group)
            x = torch.ones(1, nbytes // 4)
            net(x).sum().backward()  # warm-up
            dtimes = []
            for _ in range(repeats):
                model.zero_grad()
                dist.barrier(group=ctx.worker_group)
                t0 = time.perf_counter()
                net(x).sum().backward()
                dtimes.append(time.perf_counter() - t0)
            out[str(nbytes)]["ddp"] = statistics.median(dtimes)
            del net
    if hetrain.rank() == 0:
        print(MARK + json.dumps(out), flush=True)
    hetrain.shutdown()


def cluster_file(n: int, k: int, rate: str, tmp: Path, mtu: int = MTU) -> Path:
    machines = [{"name": f"w{i}", "role": "worker", "device": {"speed": 1.0}, "bandwidth": rate} for i in range(n)]
    machines += [{"name": f"c{j}", "role": "cpu", "bandwidth": rate} for j in range(k)]
    path = tmp / f"n{n}k{k}.yaml"
    net = {"emulate": "netns", "mtu": mtu}
    path.write_text(yaml.safe_dump({"name": f"bench-n{n}-k{k}", "network": net, "machines": machines}))
    return path


def run_case(cfile: Path, mode: str, sizes: list[int], repeats: int, partition: int, ddp: bool) -> dict:
    lanes = ["--max-lanes", "8"] if mode == "byteps-lanes" else []
    mode = mode.split("-")[0]
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", mode, *lanes,
           "--partition-bytes", str(partition), "--timeout", "120", "--run-dir", str(cfile.parent / f"run-{mode}"),
           str(Path(__file__).resolve()), "--worker", "--sizes", ",".join(map(str, sizes)),
           "--repeats", str(repeats)] + (["--ddp"] if ddp else [])
    env = repo_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    raise RuntimeError(f"case {cfile.name} {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="byteps + all-reduce/DDP only, 2 sizes (< 3 min)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--rate", default="400mbit", help="NIC bandwidth of every machine")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mtu", type=int, default=MTU, help="MTU of the emulated links")
    ap.add_argument("--partition-bytes", type=int, default=65_536,
                    help="BytePS's 4 MB is ~1.3 ms on a 25 Gbit/s link; 64 KB is that on these 400 Mbit/s links")
    ap.add_argument("--sections", default="colocated,server_link,cases",
                    help="colocated: processes of this host, shared memory vs gloo; server_link: workers and a "
                         "summation server of this host, shared memory vs gloo; cases: the emulated cluster")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker([int(s) for s in args.sizes.split(",")], args.repeats, args.ddp)
        return 0

    sections = set(args.sections.split(","))
    out: dict = {}
    if "colocated" in sections:
        import colocated

        out["colocated"] = colocated.run([2, 4], [4_000_000, 100_000_000], args.repeats)
        print("\nall-reduce among processes of this host: shared memory vs gloo\n" + colocated.table(out["colocated"]))
        if args.json:  # written now too: the cases below take long
            Path(args.json).write_text(json.dumps(out, indent=2))
    if "server_link" in sections:
        import server_link

        out["server_link"] = server_link.run(repeats=10 if args.quick else 20, launches=2 if args.quick else 4)
        print("\npush_pull, 2 workers + 1 summation server on this host: shared memory vs gloo\n"
              + server_link.table(out["server_link"]))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
    if "cases" not in sections:
        if args.json:
            print(f"wrote {args.json}")
        return 0
    from hetrain.cluster.netns import netns_available
    from hetrain.cluster.units import parse_rate

    reason = netns_available()
    if reason:
        print(f"bench/comm.py needs network namespaces: {reason}", file=sys.stderr)
        return 2
    n = 4
    bw = parse_rate(args.rate)
    sizes = [8_000_000, 32_000_000] if args.quick else [8_000_000, 32_000_000, 64_000_000]
    repeats = 5 if args.quick else args.repeats
    ks = [0, 1, 2, 4]
    partition = args.partition_bytes
    # byteps-lanes: the ablation of lanes (parallel connections ∝ share, up to 8), where shares differ
    modes_for = (lambda k: ["byteps"]) if args.quick else (
        lambda k: ["byteps", "colocated"] + (["ps"] if k else []) + (["byteps-lanes"] if 0 < k < n else []))
    cases = []
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        # DDP / all-reduce do not use CPU machines: measure them once on the n workers
        base = run_case(cluster_file(n, 0, args.rate, tmp, args.mtu), "allreduce", sizes, repeats, partition, True)
        from tqdm import tqdm

        jobs = [(k, mode) for k in ks for mode in modes_for(k)]
        for k, mode in tqdm(jobs, desc="cases", file=sys.stderr):
            res = run_case(cluster_file(n, k, args.rate, tmp, args.mtu), mode, sizes, repeats, partition, False)
            for nbytes in sizes:
                cases.append({"n": n, "k": k, "mode": mode, "bytes": nbytes,
                              "measured_s": res[str(nbytes)]["push_pull"], "all_s": res[str(nbytes)]["all"],
                              "t_opt_s": byteps_time(nbytes, n, k, bw), "ddp_s": base[str(nbytes)]["ddp"],
                              "theory_s": {"byteps": byteps_time(nbytes, n, k, bw),
                                           "byteps-lanes": byteps_time(nbytes, n, k, bw),
                                           "colocated": ring_allreduce_time(nbytes, n, bw),
                                           "ps": ps_time(nbytes, n, max(k, 1), bw)}[mode]})
        for nbytes in sizes:
            cases.append({"n": n, "k": 0, "mode": "allreduce", "bytes": nbytes,
                          "measured_s": base[str(nbytes)]["push_pull"], "all_s": base[str(nbytes)]["all"],
                          "t_opt_s": byteps_time(nbytes, n, 0, bw), "ddp_s": base[str(nbytes)]["ddp"],
                          "theory_s": ring_allreduce_time(nbytes, n, bw)})
    head = (f"{'k':>2} {'mode':<13}{'MB':>6}{'measured s':>12}{'theory s':>10}{'t_opt s':>9}{'meas/t_opt':>11}"
            f"{'DDP s':>8}{'DDP/meas':>9}{'ideal':>7}")
    print(f"\npush_pull on n={n} worker machines + k CPU machines, {args.rate} NICs (netns + tc tbf, MTU {args.mtu}); "
          f"partitions of {partition} B; medians of {repeats}")
    print(head + "\n" + "-" * len(head))
    for c in sorted(cases, key=lambda c: (c["k"], c["mode"], c["bytes"])):
        ideal = byteps_speedup_over_allreduce(n, c["k"]) if c["mode"].startswith("byteps") else float("nan")
        print(f"{c['k']:>2} {c['mode']:<13}{c['bytes'] / 1e6:>6.0f}{c['measured_s']:>12.3f}{c['theory_s']:>10.3f}"
              f"{c['t_opt_s']:>9.3f}{c['measured_s'] / c['t_opt_s']:>11.2f}{c['ddp_s']:>8.3f}"
              f"{c['ddp_s'] / c['measured_s']:>9.2f}{ideal:>7.2f}")
    print(f"(ideal = theoretical BytePS speed-up over all-reduce, 1 + k(n-2)/n²; wall {time.time() - t_start:.0f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "rate": args.rate, "mtu": args.mtu, "partition_bytes": partition,
                                               "repeats": repeats, "cases": cases}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
