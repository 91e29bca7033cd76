"""push_pull between workers and a summation server on this host: partitions through
shared memory (`--server-link auto`, comm/shm/channel.py) beside gloo over TCP loopback
(`--server-link gloo`), in the same run.

Two workers and one CPU summation server (`--mode ps`, BytePS's partition size), all
on this host, launched by `hetrain launch`; each launch times `hetrain.push_pull` of a
4 MB and a 100 MB fp32 tensor (rank 0's wall time per call, after warm-up calls, the
median of the repeats). The links take turns (gloo, shm, shm, gloo, ...) so a host whose
load drifts slows both alike; the table gives the median over launches.

`server_copies_s` = 4·N/S, S one thread's memcpy speed measured here (perf.comm.
memcpy_speed): the server's copies alone for an N-byte push_pull of 2 workers through
its mailbox (both pushes out of their rings, the sum into both workers' rings), which
its one copying thread makes one after another; the sum itself and the workers' copies
overlap them only where cores are free.

    python bench/server_link.py [--quick] [--json out.json]
    python bench/comm.py --sections server_link --json out.json
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
sys.path.insert(0, str(ROOT / "bench"))

from pinned_pair import repo_env  # noqa: E402

SIZES = (4_000_000, 100_000_000)
LINKS = ("gloo", "auto")
NAMES = {"gloo": "gloo_s", "auto": "shm_s"}
WARM = 2


def worker(out: str, sizes: list[int], repeats: int) -> None:
    """In each launched worker: push_pull each size `repeats` times; rank 0 writes its times."""
    import torch

    import hetrain

    hetrain.init()
    times: dict[int, list[float]] = {}
    for nbytes in sizes:
        t = torch.randn(nbytes // 4)
        for _ in range(WARM):
            hetrain.push_pull([("g", t)])
        times[nbytes] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            hetrain.push_pull([("g", t)])
            times[nbytes].append(time.perf_counter() - t0)
        del t
    if hetrain.rank() == 0:
        Path(out).write_text(json.dumps({str(k): v for k, v in times.items()}))
    hetrain.shutdown()


def _launch(tmp: Path, tag: str, link: str, sizes: list[int], repeats: int) -> dict[int, float]:
    cluster = {"name": "server-link", "machines": [{"name": "w0", "role": "worker", "device": {}},
                                                   {"name": "w1", "role": "worker", "device": {}},
                                                   {"name": "c0", "role": "cpu"}]}
    cfile = tmp / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp / f"{tag}.json"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--quiet", "--cluster", str(cfile), "--mode", "ps",
           "--server-link", link, "--run-dir", str(tmp / f"run-{tag}"), str(Path(__file__).resolve()), "--worker",
           "--out", str(out), "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    subprocess.run(cmd, check=True, env=repo_env(), timeout=900)
    return {int(k): statistics.median(v) for k, v in json.loads(out.read_text()).items()}


def run(sizes: list[int] = list(SIZES), repeats: int = 5, launches: int = 2) -> list[dict]:
    """One case per size: shm_s, gloo_s (medians over launches of each launch's median)."""
    from hetrain.perf.comm import memcpy_speed

    speed = memcpy_speed(100_000_000, 5)
    got: dict[str, list[dict[int, float]]] = {link: [] for link in LINKS}
    with tempfile.TemporaryDirectory(prefix="server-link-") as d:
        for k in range(launches):
            for link in (LINKS if k % 2 == 0 else LINKS[::-1]):
                got[link].append(_launch(Path(d), f"{link}-{k}", link, sizes, repeats))
                print(f"  [{link} launch {k + 1}/{launches}]", flush=True)
    cases = []
    for nbytes in sizes:
        c = {NAMES[link]: statistics.median(r[nbytes] for r in got[link]) for link in LINKS}
        c.update(bytes=nbytes, server_copies_s=4 * nbytes / speed, gloo_over_shm=c["gloo_s"] / c["shm_s"],
                 shm_GBps=2 * nbytes / c["shm_s"] / 1e9, gloo_GBps=2 * nbytes / c["gloo_s"] / 1e9,
                 memcpy_Bps=speed, repeats=repeats, launches=launches, workers=2, servers=1, mode="ps",
                 cores=len(os.sched_getaffinity(0)))
        cases.append(c)
    return cases


def table(cases: list[dict]) -> str:
    head = f"{'MB':>5}{'shm s':>9}{'gloo s':>9}{'gloo/shm':>9}{'shm GB/s':>9}{'gloo GB/s':>10}{'copies s':>9}"
    rows = [f"{c['bytes'] / 1e6:>5.0f}{c['shm_s']:>9.4f}{c['gloo_s']:>9.4f}{c['gloo_over_shm']:>9.2f}"
            f"{c['shm_GBps']:>9.2f}{c['gloo_GBps']:>10.2f}{c['server_copies_s']:>9.4f}" for c in cases]
    return "\n".join([head, *rows]) + "\n(GB/s: a worker's pushed and pulled bytes, 2N, per call)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 launches per link, 10 calls per size (~1-2 min)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.worker:
        worker(a.out, sizes, a.repeats)
        return 0
    cases = run(sizes, 10 if a.quick else 20, 2 if a.quick else 4)
    print("\npush_pull, 2 workers + 1 summation server on this host: shared memory vs gloo\n" + table(cases))
    if a.json:
        Path(a.json).write_text(json.dumps({"server_link": cases}, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
