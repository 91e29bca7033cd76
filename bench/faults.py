"""Fault campaign: inject real faults into the digits demo on an emulated cluster and
measure what hetrain's elastic recovery does with them.

Cluster: 3 worker machines (speeds 1, 0.5, 1) and 1 CPU machine, each in its own
network namespace with a tc-shaped 1 Gbit/s link (needs root), mode byteps (so 3
co-located summation servers and one on the CPU machine), `hetrain launch
--max-restarts 1000 --timeout T -m hetrain.demo.digits --commit-every 5`. For each kind
of fault one job runs; after each fault the campaign waits for the job to recover,
lets it train a random 1-3 s (random steps), and injects the next:

    kill-worker       SIGKILL of a random worker
    kill-server       SIGKILL of a random summation server (co-located or CPU machine)
    stop-worker       SIGSTOP of a random worker (a hang)
    stop-server       SIGSTOP of a random summation server
    link-down         `ip link set <veth> down` on a random machine's link for 3 s
    rogue-join        a process without the job secret asks to join (join request) and
                      tries to claim rank 0 of the running round
    truncated-commit  a worker that writes a replica of the commits (ranks 0 and 1, in
                      turn) is killed and the newest commit file on its machine is
                      truncated to half (a torn write), beside a partial temporary file
                      (a writer killed mid-write)
    garbage           random bytes sent to every listening port of a random summation
                      server and to the rendezvous store, by a process outside the job

Per fault: recovered (the job committed again: in a new round after a restart, or past
the disturbance in the same round), reported (the launcher named the faulty process,
rank and machine, or refused the impostor; for truncation the damaged file was
reported too), seconds from injection to recovery and to the report, committed updates
lost (optimizer steps committed before the fault and not restored after it), and hangs
(neither within the limit). The cost of a cold start (launch to the first commit) is
measured in the same runs, for comparison with the recovery time.

    python bench/faults.py --quick --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hetrain.runtime.env import ProcEnv  # noqa: E402
from hetrain.runtime.topology import build_topology  # noqa: E402
from hetrain.train.checkpoint import CommitStore, loads  # noqa: E402
from faults_report import plot, summarise, table  # noqa: E402
from pinned_pair import repo_env  # noqa: E402

KINDS = ("kill-worker", "kill-server", "stop-worker", "stop-server", "link-down", "rogue-join", "truncated-commit",
         "garbage")
RESTARTING = ("kill-worker", "kill-server", "stop-worker", "stop-server", "truncated-commit")
LINK_DOWN_S = 3.0

ROGUE = r"""
import json, sys, time, uuid
from datetime import timedelta
import torch.distributed as dist
addr, port, rnd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=10))
at = time.time()  # when the impostor reaches the job (its own start-up does not count)
n = s.add("hetrain/joins", 1) - 1  # ask to join as node 1 with a made-up proof
s.set(f"hetrain/join/{n}", json.dumps({"node": 1, "instance": uuid.uuid4().hex[:12], "proof": "0" * 64}))
fake = "f" * 64  # and try to take rank 0 of the running round
got = s.compare_set(f"round{rnd}/hetrain/auth/0", "", fake).decode()
print(json.dumps({"claimed_rank0": got == fake, "at": at}))
"""


def cluster_file(path: Path) -> Path:
    machines = [{"name": f"w{i}", "role": "worker", "device": {"kind": f"emu{s:g}", "speed": s, "memory": "2GiB"},
                 "bandwidth": "1gbit"} for i, s in enumerate([1.0, 0.5, 1.0])]
    machines.append({"name": "c0", "role": "cpu", "bandwidth": "1gbit"})
    path.write_text(yaml.safe_dump({"name": "faults", "machines": machines,
                                    "network": {"emulate": "netns", "mtu": 9000}}))
    return path


@dataclass
class Commit:
    seq: int
    round: int
    step: int  # global step of the committed position (optimizer updates before it)
    seen_at: float


@dataclass
class Fault:
    kind: str
    victim: str = ""
    round: int = 0
    recovered: bool = False
    reported: bool = False
    in_time: bool = False  # recovered or reported within the peer timeout + 5 s
    hang: bool = False
    recover_s: float | None = None
    report_s: float | None = None
    restarted: bool = False
    lost_updates: int = 0
    survivors_naming: int = 0
    survivors_total: int = 0
    damage_reported: bool = False  # truncated-commit: a rank reported the damaged file at restore
    note: str = ""


class Job:
    """One `hetrain launch` of the demo, its output timestamped, its commits watched."""

    def __init__(self, work: Path, timeout: float, name: str):
        self.run_dir = work / f"run-{name}"
        self.timeout = timeout
        cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cluster_file(work / "cluster.yaml")),
               "--timeout", str(timeout), "--max-restarts", "1000", "--rejoin-after", "20",
               "--run-dir", str(self.run_dir), "-m", "hetrain.demo.digits", "--epochs", "100000",
               "--commit-every", "5"]
        env = repo_env()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        self.commit: Commit | None = None
        self._seen_seq = 0

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def since(self, t: float) -> list[tuple[float, str]]:
        with self._lock:
            return [(u, line) for u, line in self.lines if u >= t]

    def poll_commit(self) -> Commit | None:
        """The newest commit on disk (any replica); read it only when it is new."""
        root = self.run_dir / "elastic"
        if not root.is_dir():
            return self.commit
        best = None
        for sub in root.iterdir():
            for p in sub.glob("commit-*.pt"):
                m = CommitStore.PATTERN.match(p.name)
                if m and (best is None or int(m.group(1)) > best[0]):
                    best = (int(m.group(1)), sub.name)
        if best is None or best[0] <= self._seen_seq:
            return self.commit
        found = CommitStore(root, best[1]).newest()
        if found is None or found[0] <= self._seen_seq:
            return self.commit
        snap = loads(found[1])
        sampler = snap["objects"]["loader"]  # the demo commits its BalancedLoader's data position
        spe = -(-int(sampler["num_samples"]) // int(sampler["global_batch"]))
        self._seen_seq = found[0]
        self.commit = Commit(found[0], int(snap["meta"]["round"]), int(sampler["epoch"]) * spe + int(sampler["step"]),
                             time.monotonic())
        return self.commit

    def wait_training(self, limit: float) -> Commit:
        end = time.monotonic() + limit
        rnd = self.current_round()
        while time.monotonic() < end:
            c = self.poll_commit()
            rnd = self.current_round()
            if c is not None and c.round == rnd and self.alive():
                return c
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended (exit {self.proc.returncode}):\n" + self.tail())
            time.sleep(0.2)
        raise RuntimeError(f"the job did not train within {limit:.0f} s:\n" + self.tail())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def current_round(self) -> int:
        rounds = [int(m.group(1)) for _, line in self.since(0) for m in [re.match(r"hetrain: round (\d+):", line)] if m]
        return max(rounds, default=0)

    def procs(self, rnd: int) -> dict[int, tuple[int, object]]:
        """rank -> (pid, Proc) of round `rnd`."""
        out, topo = {}, None
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            env = dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)
            if env.get("HETRAIN_RUN_DIR") != str(self.run_dir) or env.get("HETRAIN_RESTART") != str(rnd):
                continue
            pe = ProcEnv.from_environ(env)
            if pe is None:
                continue
            if topo is None:
                from hetrain.cluster.spec import ClusterSpec
                topo = build_topology(ClusterSpec.model_validate_json(pe.cluster_json), pe.comm.mode)
                self.master = (pe.master_addr, pe.master_port)
            out[pe.rank] = (int(pid), topo.proc(pe.rank), topo)
        return out

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.since(0)[-n:])

    def stop(self, limit: float = 90) -> int:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGUSR1)  # stop at the next commit, cleanly
            try:
                self.proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def describe(proc) -> str:
    return f"rank {proc.rank} ({proc.role} on machine {proc.machine.name})"


def netns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


def listening_ports(pid: int) -> list[tuple[str, int]]:
    ns = netns_of(pid)
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            addr, port = line.split()[3].rsplit(":", 1)
            ports.append((addr, int(port)))
    return ports


def send_garbage(addr: str, port: int, rng: random.Random) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=3) as s:
            s.sendall(rng.randbytes(4096))
            s.settimeout(0.5)
            try:
                s.recv(64)
            except OSError:
                pass
        return True
    except OSError:
        return False


def inject(job: Job, kind: str, rnd: int, rng: random.Random, fault: Fault, nth: int = 0) -> dict:
    """Do it; returns what the outcome check needs (t_inj: when the fault hit, if later
    than the call; t_end: when the disturbance ended, for faults that do not restart)."""
    procs = job.procs(rnd)
    workers = sorted(r for r, (_, p, _) in procs.items() if p.role == "worker")
    servers = sorted(r for r, (_, p, _) in procs.items() if p.role == "server")
    info: dict = {"t_end": None, "nth": nth}
    if kind in ("kill-worker", "stop-worker", "kill-server", "stop-server"):
        rank = rng.choice(workers if kind.endswith("worker") else servers)
        pid, proc, _ = procs[rank]
        fault.victim = describe(proc)
        os.kill(pid, signal.SIGKILL if kind.startswith("kill") else signal.SIGSTOP)
    elif kind == "truncated-commit":
        # ranks 0 and 1 each write a replica on their own machine: alternate between them
        # (a machine that fails with its own copy torn; the other machine's copy is intact)
        rank = workers[nth % min(2, len(workers))]
        pid, proc, _ = procs[rank]
        fault.victim = describe(proc)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)  # a commit rank 0 was writing lands first; then tear the newest on its disk
        folder = job.run_dir / "elastic" / proc.machine.name
        files = sorted(folder.glob("commit-*.pt"))
        if files:
            data = files[-1].read_bytes()
            files[-1].write_bytes(data[: len(data) // 2])
            (folder / f".{files[-1].name}.crashed").write_bytes(data[: len(data) // 3])
            fault.note = f"truncated {files[-1].name}"
    elif kind == "link-down":
        rank = rng.choice(sorted(procs))
        pid, proc, _ = procs[rank]
        ns = netns_of(pid)
        veth = "hp" + ns[len("het"):]
        fault.victim = f"link of machine {proc.machine.name}"
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        time.sleep(LINK_DOWN_S)
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        info["t_end"] = time.monotonic()
    elif kind == "rogue-join":
        addr, port = job.master
        out = subprocess.run([sys.executable, "-c", ROGUE, addr, str(port), str(rnd)], capture_output=True,
                             text=True, env=repo_env(), timeout=60)
        claimed = '"claimed_rank0": true' in out.stdout
        try:
            at = json.loads(out.stdout.strip().splitlines()[-1])["at"]
            info["t_inj"] = time.monotonic() - (time.time() - at)
        except (ValueError, KeyError, IndexError):
            pass
        fault.victim = "impostor without the secret"
        fault.note = "took rank 0's slot!" if claimed else "could not take rank 0's slot"
        info["t_end"] = time.monotonic()
    elif kind == "garbage":
        rank = rng.choice(servers)
        pid, proc, _ = procs[rank]
        fault.victim = describe(proc)
        hit = [p for a, p in listening_ports(pid) if send_garbage(a, p, rng)]
        store_hit = send_garbage(*job.master, rng)
        fault.note = f"{len(hit)} server port(s), store {'hit' if store_hit else 'missed'}"
        info["t_end"] = time.monotonic()
    return info


def report_seen(kind: str, fault: Fault, lines: list[tuple[float, str]]) -> float | None:
    """When the launcher (or a rank) reported this fault, if it did."""
    want = {
        "kill-worker": [f"hetrain: {fault.victim} failed (killed by SIGKILL)"],
        "kill-server": [f"hetrain: {fault.victim} failed (killed by SIGKILL)"],
        "stop-worker": [f"hetrain: {fault.victim} stopped answering"],
        "stop-server": [f"hetrain: {fault.victim} stopped answering"],
        "truncated-commit": [f"hetrain: {fault.victim} failed (killed by SIGKILL)"],
        "rogue-join": ["hetrain: refused a process that asked to join"],
        "link-down": ["hetrain: rank"],
        "garbage": ["hetrain: rank"],
    }[kind]
    times = []
    for pattern in want:
        hit = next((t for t, line in lines if pattern in line), None)
        if hit is None:
            return None
        times.append(hit)
    return max(times)


def outcome(job: Job, kind: str, fault: Fault, t_inj: float, before: Commit, info: dict, limit: float) -> None:
    end = t_inj + limit
    t_end = info.get("t_end") or t_inj
    while time.monotonic() < end and job.alive():
        c = job.poll_commit()
        lines = job.since(t_inj)
        if fault.report_s is None:
            t = report_seen(kind, fault, lines)
            if t is not None:
                fault.report_s, fault.reported = t - t_inj, True
        if c is not None and c.round > fault.round:
            fault.restarted = True
            fault.recovered, fault.recover_s = True, c.seen_at - t_inj
        elif c is not None and kind not in RESTARTING and c.seq > before.seq and c.seen_at > t_end:
            fault.recovered, fault.recover_s = True, c.seen_at - t_inj
        if fault.recovered and (fault.reported or kind in ("link-down", "garbage")
                                or time.monotonic() - t_inj > job.timeout + 10):
            break
        time.sleep(0.1)
    fault.hang = not fault.recovered and not fault.reported
    slack = job.timeout + 5
    fault.in_time = bool((fault.report_s is not None and fault.report_s <= slack)
                         or (fault.recover_s is not None and fault.recover_s <= slack))
    lines = [line for _, line in job.since(t_inj)]
    fault.damage_reported = kind == "truncated-commit" and any("is damaged" in line for line in lines)
    if fault.restarted:
        resumed = [(int(r), int(e), int(s)) for line in lines
                   for r, e, s in re.findall(r"round (\d+) resumed from commit \d+ \(epoch (\d+), step (\d+)\)", line)]
        resumed = [x for x in resumed if x[0] > fault.round]
        if resumed:
            _, e, s = min(resumed)
            spe = -(-1257 // 64)  # the demo's train split and global batch
            fault.lost_updates = max(0, before.step - (e * spe + s))
    if fault.victim.startswith("rank"):
        peers = [line for line in lines if "PeerLostError: rank" in line and f"[{fault.victim.split()[1]}:" not in line]
        fault.survivors_total = len(peers)
        fault.survivors_naming = sum(f"lost {fault.victim}" in line for line in peers)


def campaign(kind: str, n: int, work: Path, timeout: float, rng: random.Random, log,
             logs: Path | None = None) -> tuple[list[Fault], float]:
    job = Job(work, timeout, kind)
    faults: list[Fault] = []
    try:
        first = job.wait_training(600)
        cold = first.seen_at - job.t0
        log(f"  {kind}: cold start {cold:.1f} s (launch to first commit)")
        for i in range(n):
            c = job.wait_training(300)
            time.sleep(rng.uniform(1.0, 3.0))  # a random step
            before = job.poll_commit() or c
            fault = Fault(kind, round=job.current_round())
            t_inj = time.monotonic()
            info = inject(job, kind, fault.round, rng, fault, nth=i)
            outcome(job, kind, fault, info.get("t_inj") or t_inj, before, info, limit=timeout + 150)
            faults.append(fault)
            log(f"  {kind} #{i + 1}: {fault.victim}: recovered={fault.recovered} in {fault.recover_s or 0:.1f} s, "
                f"reported={fault.reported} in {fault.report_s or 0:.1f} s, lost={fault.lost_updates}, "
                f"survivors naming it {fault.survivors_naming}/{fault.survivors_total} {fault.note}")
            if fault.hang:
                log(job.tail(60))
                break
        rc = job.stop()
        if rc != 3:
            log(f"  {kind}: the job did not stop cleanly on request (exit {rc})\n{job.tail(30)}")
    finally:
        if job.alive():
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
        subprocess.run([sys.executable, "-m", "hetrain.cli", "netns", "cleanup"], capture_output=True, env=repo_env())
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"{kind}.log").write_text("\n".join(f"{t - job.t0:9.2f} {line}" for t, line in job.since(0)))
    return faults, cold


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="7 faults of each kind (56), else 15 (120)")
    ap.add_argument("--per-kind", type=int, help="faults of each kind (overrides --quick)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ", ".join(KINDS))
    ap.add_argument("--timeout", type=float, default=12.0, help="peer timeout (--timeout of hetrain launch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--logs", help="keep each job's timestamped output in this folder")
    ap.add_argument("--png", help="write the figure here (default: beside --json)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        print("bench/faults.py: skipped: needs root and network namespaces (ip netns)")
        return 0
    n = args.per_kind or (7 if args.quick else 15)
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kinds {bad}; choose from {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    # SIGTERM: unwind through the `finally` blocks, which stop the jobs and their namespaces
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    load_start = os.getloadavg()
    t0 = time.time()
    faults: list[Fault] = []
    colds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hetrain-faults-") as tmp:
        for kind in kinds:
            fs, cold = campaign(kind, n, Path(tmp), args.timeout, rng, lambda s: print(s, flush=True),
                                Path(args.logs) if args.logs else None)
            faults += fs
            colds.append(cold)
    cold = statistics.median(colds)
    rows = summarise(faults, KINDS)
    print()
    print(table(rows, cold, args.timeout))
    load_end = os.getloadavg()
    print(f"{len(faults)} faults in {(time.time() - t0) / 60:.1f} min; load average {load_start[0]:.1f} at start, "
          f"{load_end[0]:.1f} at end, on {os.cpu_count()} cores")
    result = {"kinds": rows, "cold_start_s": cold, "cold_starts_s": colds, "timeout_s": args.timeout,
              "faults": [asdict(f) for f in faults], "total": len(faults),
              "all_in_time": all(f.in_time for f in faults), "lost_updates": sum(f.lost_updates for f in faults),
              "hangs": sum(f.hang for f in faults), "load_average": {"start": load_start, "end": load_end},
              "cores": os.cpu_count(), "minutes": (time.time() - t0) / 60,
              "workload": "digits demo, 3 workers (speeds 1, 0.5, 1) + 1 CPU machine, byteps, netns 1 Gbit/s links, "
                          "commit every 5 steps"}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        png = Path(args.png) if args.png else Path(args.json).with_suffix(".png")
        plot(faults, KINDS, cold, args.timeout, png)
        print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
