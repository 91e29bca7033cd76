"""The single launcher: start every worker and summation server of a cluster.

Locally it runs the whole cluster on this host (an *embedded* cluster). Across
machines, the same command runs on each node with `--node-rank` and the master's
address, torchrun-style: node 0 hosts the torch.distributed TCPStore (bound to the
cluster address only) and every process rendezvouses through it. The launcher
streams each process's output with a rank prefix; when a process fails it records
the dead rank in the store (so the others can name it), gives the rest `timeout_s`
to stop on their own, then stops them, and returns non-zero with the failing
rank's error.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ..cluster.spec import ClusterSpec
from ..errors import UserError
from . import STOP_REQUESTED
from .auth import new_secret
from .env import CommConfig, ProcEnv
from .topology import Proc, build_topology

EXIT_STOPPED = 3  # a process stopped at a checkpoint because it was asked to (SIGUSR1)


@dataclass
class LaunchConfig:
    cluster: ClusterSpec
    argv: list[str]  # script.py args... or -m module args...
    comm: CommConfig = field(default_factory=CommConfig)
    node_rank: int | None = None  # None: run every node's processes here
    master_addr: str | None = None
    master_port: int = 0  # 0: pick a free one (single node only)
    secret: str | None = None
    run_dir: str | None = None
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.argv:
            raise UserError("nothing to launch: give a script (`hetrain launch train.py`) or `-m module`")
        if self.node_rank is not None:
            if not 0 <= self.node_rank < self.cluster.nnodes:
                raise UserError(f"--node-rank {self.node_rank} is outside 0..{self.cluster.nnodes - 1} "
                                f"(the cluster file assigns machines to {self.cluster.nnodes} node(s))")
            if self.cluster.nnodes > 1 and (not self.master_addr or not self.master_port):
                raise UserError("a multi-node launch needs --master-addr and --master-port (the same on every node)")


@dataclass
class Child:
    proc: Proc
    popen: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=60))
    reader: threading.Thread | None = None


def _listen(addr: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as err:
        raise UserError(f"cannot listen on {addr}:{port} for the job's rendezvous store: {err}; "
                        "pick another --master-port or check --master-addr is this node's cluster address") from None
    sock.listen(512)
    return sock


def _is_consequence(child: "Child") -> bool:
    return any("PeerLostError" in line or "Connection closed by peer" in line for line in child.tail)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Launcher:
    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        self.job_id = uuid.uuid4().hex[:8]
        self.netns = None
        self._print_lock = threading.Lock()
        self.run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{self.job_id}")

    # ---- public -------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        cluster = cfg.cluster
        emulate = cluster.network.emulate
        if emulate == "auto":
            from ..cluster.netns import netns_available
            emulate = "netns" if netns_available() is None and cfg.node_rank is None else "ratelimit"
        self.ratelimit_dir = None
        if emulate == "ratelimit":
            import tempfile
            self.ratelimit_dir = tempfile.mkdtemp(prefix=f"hetrain-{self.job_id}-",
                                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        if emulate == "netns":
            if cfg.node_rank is not None:
                raise UserError("netns emulation runs a whole cluster on one host; drop --node-rank or set emulate: none")
            from ..cluster.netns import NetnsCluster
            self.netns = NetnsCluster(cluster)
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGUSR1, self._forward)
        try:
            if self.netns is not None:
                cluster = self.netns.up()
                self._log(f"hetrain: emulated network: {len(cluster.machines)} namespaces on bridge "
                          f"{self.netns.bridge}, tbf-shaped links, {self.netns.qdisc_used} queues")
            return self._run(cluster)
        finally:
            self._stop_all(grace=3.0)
            if self.netns is not None:
                self.netns.down()
            if self.ratelimit_dir:
                import shutil
                shutil.rmtree(self.ratelimit_dir, ignore_errors=True)
            for s, h in old.items():
                signal.signal(s, h)

    # ---- internals ----------------------------------------------------------------------
    def _forward(self, signum=signal.SIGUSR1, frame=None) -> None:
        """SIGUSR1 asks the job to checkpoint and stop (elastic resizing): pass it on."""
        STOP_REQUESTED.set()
        for c in self.children:
            if c.popen.poll() is None:
                self._signal(c, signum)

    def _on_signal(self, signum, frame) -> None:
        raise KeyboardInterrupt(f"launcher got {signal.Signals(signum).name}")

    def _run(self, cluster: ClusterSpec) -> int:
        cfg = self.cfg
        topo = build_topology(cluster, cfg.comm.mode)
        local = [p for p in topo.procs if cfg.node_rank is None or p.machine.node == cfg.node_rank]
        hosting = cfg.node_rank in (None, 0)
        master_addr = cfg.master_addr or (self.netns.host_address if self.netns else topo.procs[0].machine.address)
        secret = cfg.secret or os.environ.get("HETRAIN_SECRET") or (new_secret() if cfg.node_rank is None else None)
        if secret is None:
            raise UserError("a multi-node launch needs the same secret on every node: set HETRAIN_SECRET or --secret-file")
        import torch.distributed as dist  # deferred: `hetrain --help` stays fast

        timeout = timedelta(seconds=max(cfg.comm.timeout_s, 30))
        if hosting:
            sock = _listen(master_addr, cfg.master_port)
            port = sock.getsockname()[1]
            store = dist.TCPStore(master_addr, port, None, True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=sock.fileno())
            store.set("hetrain/nonce", uuid.uuid4().hex)
        else:
            port = cfg.master_port
            store = dist.TCPStore(master_addr, port, None, False, timeout=timeout)
        self.store = store
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log(f"hetrain: job {self.job_id}, mode {cfg.comm.mode}, {len(topo.workers)} workers + "
                  f"{len(topo.servers)} summation servers; this node starts {len(local)} processes; "
                  f"logs in {self.run_dir}")
        if STOP_REQUESTED.is_set():  # asked to stop before any process started: nothing ran, nothing to save
            self._log("hetrain: stop requested before the job started; relaunch to run it")
            return EXIT_STOPPED
        for p in local:
            env = process_env(cfg, p, topo.world_size, cluster, master_addr, port, self.job_id, secret,
                              str(self.run_dir), self.ratelimit_dir)
            child = Child(p, self._spawn(p, process_args(cfg, p), env))
            child.reader = threading.Thread(target=self._pump, args=(child,), daemon=True)
            child.reader.start()
            self.children.append(child)
        if STOP_REQUESTED.is_set():  # asked while the processes were being started
            self._forward()
        return self._monitor(topo)

    def _spawn(self, p: Proc, args: list[str], env: dict[str, str]):
        """Start one process of the job here; returns its Popen (or a handle like it)."""
        argv = [sys.executable, *args]
        if self.netns is not None:
            argv = self.netns.wrap(p.machine.name, argv)
        return start_process(argv, full_env(env))

    def _signal(self, child: Child, signum: int) -> None:
        """Send a signal to a process and its children."""
        try:
            os.killpg(child.popen.pid, signum)
        except ProcessLookupError:
            pass

    def _exit_text(self, child: Child) -> str:
        return _describe_exit(child.popen.returncode)

    def _pump(self, child: Child) -> None:
        prefix = f"[{child.proc.rank}:{child.proc.label}]"
        for raw in child.popen.stdout:
            # progress bars redraw with \r: show each redraw as its own line
            for line in raw.decode(errors="replace").rstrip("\n").split("\r"):
                if not line.strip():
                    continue
                child.tail.append(line)
                if not self.cfg.quiet:
                    self._log(f"{prefix} {line}")

    def _log(self, text: str) -> None:
        with self._print_lock:
            print(text, flush=True)

    def _monitor(self, topo) -> int:
        first: Child | None = None
        deadline = None
        while True:
            running = [c for c in self.children if c.popen.poll() is None]
            failed = [c for c in self.children if c.popen.returncode not in (None, 0, EXIT_STOPPED)]
            # several may be seen failing in one poll: blame the root cause, not the
            # processes that failed because they lost it
            failed.sort(key=lambda c: (_is_consequence(c), c.proc.rank))
            for c in failed[:1]:
                code = c.popen.returncode
                # blame the root cause: a process that failed because it lost a peer gives way to
                # the peer when that one is seen later (a lost Ray node is reported after its survivors)
                if first is None or (c is not first and _is_consequence(first) and not _is_consequence(c)):
                    first = c
                    try:
                        self.store.set(f"hetrain/dead/{c.proc.rank}", str(code))
                    except Exception:
                        pass
                    self._log(f"hetrain: {topo.describe(c.proc.rank)} failed ({self._exit_text(c)}); "
                              f"waiting up to {self.cfg.comm.timeout_s:.0f}s for the others to stop")
                    deadline = time.monotonic() + self.cfg.comm.timeout_s + 5
            if not running:
                break
            if deadline is not None and time.monotonic() > deadline:
                self._log("hetrain: some processes did not stop in time; terminating them")
                self._stop_all(grace=5.0)
                break
            time.sleep(0.1)
        for c in self.children:
            if c.reader:
                c.reader.join(timeout=5)
        if first is None:
            if any(c.popen.returncode == EXIT_STOPPED for c in self.children):
                self._log("hetrain: job stopped at a checkpoint on request; relaunch to resume")
                return EXIT_STOPPED
            self._log(f"hetrain: all {len(self.children)} processes finished")
            return 0
        tail = "\n".join(f"    {line}" for line in list(first.tail)[-15:])
        self._log(f"hetrain: job failed: {topo.describe(first.proc.rank)} ({self._exit_text(first)}). "
                  f"Its last output:\n{tail}")
        return 1

    def _stop_all(self, grace: float) -> None:
        alive = [c for c in self.children if c.popen.poll() is None]
        for c in alive:
            self._signal(c, signal.SIGTERM)
        end = time.monotonic() + grace
        for c in alive:
            try:
                c.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(c, signal.SIGKILL)
                c.popen.wait()


def process_env(cfg: LaunchConfig, p: Proc, world_size: int, cluster: ClusterSpec, master_addr: str, port: int,
                job_id: str, secret: str, run_dir: str, ratelimit_dir: str | None = None) -> dict[str, str]:
    """hetrain's variables for one process of a job, to lay over the environment of the
    machine it runs on (`full_env`). The one place that says what a process is told."""
    env = dict(cfg.extra_env)
    env.update(ProcEnv(p.rank, world_size, master_addr, port, job_id, cluster.model_dump_json(), cfg.comm,
                       run_dir).to_environ(secret))
    if ratelimit_dir:
        env["HETRAIN_RATELIMIT_DIR"] = ratelimit_dir
    env["PYTHONUNBUFFERED"] = "1"
    return env


def full_env(overrides: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(overrides)
    env.setdefault("OMP_NUM_THREADS", "1")  # many processes share few cores
    return env


def process_args(cfg: LaunchConfig, p: Proc) -> list[str]:
    """The interpreter's arguments for one process: the user's script on workers, the
    summation service on servers."""
    return ["-u", *cfg.argv] if p.role == "worker" else ["-u", "-m", "hetrain.comm.server"]


def start_process(argv: list[str], env: dict[str, str], cwd: str | None = None,
                  die_with_parent: bool = False) -> subprocess.Popen:
    """Start a process of a job in its own session, output piped, SIGUSR1 blocked: an early
    stop request stays pending until the script installs its handler
    (hetrain.train.elastic.on_stop_request). `die_with_parent` (Linux): the kernel kills it
    when the starting thread's process dies, so no rank outlives a supervisor that is killed."""
    preexec = _pdeathsig() if die_with_parent else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _pdeathsig():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
    pr_set_pdeathsig, sigkill = 1, int(signal.SIGKILL)
    return lambda: prctl(pr_set_pdeathsig, sigkill)


def launch(cfg: LaunchConfig) -> int:
    return Launcher(cfg).run()
