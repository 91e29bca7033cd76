"""The single launcher: start every worker and summation server of a cluster.

Locally it runs the whole cluster on this host (an *embedded* cluster). Across
machines, the same command runs on each node with `--node-rank` and the master's
address, torchrun-style: node 0 hosts the torch.distributed TCPStore (bound to the
cluster address only) and every process rendezvouses through it. The launcher
streams each process's output with a rank prefix; when a process fails it records
the dead rank in the store (so the others can name it), gives the rest `timeout_s`
to stop on their own, then stops them, and returns non-zero with the failing
rank's error.

It fails fast, in the user's terms: a script or module that does not exist, or
workers that ask for more cores than the host has, are refused before anything starts;
a process that exits before the job has formed (before the rendezvous completes) ends
the job at once, since the others would only wait for it until the timeout. Output is
read in chunks as it arrives, so a progress bar's carriage-return redraws show while
the job runs.
"""
from __future__ import annotations

import codecs
import importlib.util
import ipaddress
import os
import re
import select
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
from .cores import assign_cores, describe as describe_cores, pin
from .devices import preflight
from .env import CommConfig, ProcEnv
from .netif import iface_for_address
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
    # multi-node without --node-rank (identical nodes, torchrun-style): the node hosting
    # the store is node 0, the others take 1, 2, ... in order of arrival
    assign_node_rank: bool = False
    secret: str | None = None
    run_dir: str | None = None
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    job_id: str | None = None  # default: a fresh random id (torchrun's --rdzv-id sets it)

    def __post_init__(self) -> None:
        if not self.argv:
            raise UserError("nothing to launch: give a script (`hetrain launch train.py`) or `-m module`")
        if self.node_rank is not None:
            if not 0 <= self.node_rank < self.cluster.nnodes:
                raise UserError(f"--node-rank {self.node_rank} is outside 0..{self.cluster.nnodes - 1} "
                                f"(the cluster file assigns machines to {self.cluster.nnodes} node(s))")
            if self.cluster.nnodes > 1 and (not self.master_addr or not self.master_port):
                raise UserError("a multi-node launch needs --master-addr and --master-port (the same on every node)")
        if self.assign_node_rank and (self.node_rank is not None or not self.master_addr or not self.master_port):
            raise UserError("handing out node ranks needs --master-addr and --master-port, and no --node-rank")


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


def check_entry_point(argv: list[str]) -> None:
    """Refuse a training script or module that does not exist, before anything starts
    (a typo would otherwise start every process and fail only when the servers give up
    waiting). A module is looked up as `python -m` would: from this directory first,
    then the launcher's path (which the processes inherit)."""
    cwd = os.getcwd()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise UserError("-m needs a module name (`hetrain launch -m package.module`)")
        name = argv[1]
        saved = sys.path[:]
        sys.path.insert(0, cwd)
        try:
            spec = importlib.util.find_spec(name)
            package = spec is not None and spec.submodule_search_locations is not None
            main = importlib.util.find_spec(f"{name}.__main__") if package else spec  # a package runs its __main__
        except ModuleNotFoundError:  # a parent package is missing
            spec = main = None
        except (ImportError, ValueError):  # a parent package fails to import: let the process report it
            return
        finally:
            sys.path[:] = saved
        if spec is None:
            raise UserError(f"no module named {name!r} (looked up from {cwd} and the Python path, as `python -m` "
                            "does); check the spelling, or install the package")
        if main is None:
            raise UserError(f"{name} is a package without a __main__ module, so `-m {name}` cannot run it; "
                            "name the module inside it that trains")
        return
    script = Path(argv[0])
    if not (script.is_file() or (script / "__main__.py").is_file()):
        where = "" if script.is_absolute() else f" (relative to {cwd})"
        raise UserError(f"training script {argv[0]} does not exist{where}; check the path, or use -m for a module")


def _is_local_address(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback or iface_for_address(addr) is not None
    except ValueError:
        return False


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
        self.job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.job_id)[:40] if cfg.job_id else uuid.uuid4().hex[:8]
        self.netns = None
        self._server_check_done = False
        self._print_lock = threading.Lock()
        self.run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{self.job_id}")

    # ---- public -------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        cluster = cfg.cluster
        # refused before anything starts (no namespace, store or process)
        check_entry_point(cfg.argv)
        if not cfg.assign_node_rank:
            topo = build_topology(cluster, cfg.comm.mode)
            self._cores(topo, cfg.node_rank)
            preflight(cluster, topo, cfg.comm, cfg.node_rank)  # the GPUs and NCCL this node's machines ask for
        embedded = cfg.node_rank is None and not cfg.assign_node_rank or cluster.nnodes == 1  # all runs here
        emulate = cluster.network.emulate
        if emulate == "auto":
            from ..cluster.netns import netns_available
            emulate = "netns" if netns_available() is None and embedded else "ratelimit"
        self.ratelimit_dir = None
        if emulate == "ratelimit":
            import tempfile
            self.ratelimit_dir = tempfile.mkdtemp(prefix=f"hetrain-{self.job_id}-",
                                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        if emulate == "netns":
            if not embedded:
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

    @staticmethod
    def _local(topo, node_rank: int | None) -> list[Proc]:
        """The processes this launcher starts, in rank order (workers first)."""
        return [p for p in topo.procs if node_rank is None or p.machine.node == node_rank]

    def _cores(self, topo, node_rank: int | None):
        """Cores of this host for the workers that declare `threads:` (raises when they do not fit)."""
        return assign_cores(self._local(topo, node_rank), sorted(os.sched_getaffinity(0)))

    def _open_store(self, dist, master_addr: str, timeout: timedelta):
        """Host the rendezvous store (node 0) or connect to it; hand out this node's rank
        when the nodes are identical and none was given. Returns (store, port, node_rank)."""
        cfg = self.cfg
        node_rank = cfg.node_rank
        hosting = node_rank in (None, 0) and not cfg.assign_node_rank
        sock = None
        if cfg.assign_node_rank and _is_local_address(master_addr):
            try:  # the rendezvous host is this machine: host it, unless another launcher here already does
                sock = _listen(master_addr, cfg.master_port)
                hosting = True
            except UserError:
                sock = None
        if hosting:
            sock = sock or _listen(master_addr, cfg.master_port)
            self._listen_sock = sock  # TCPStore serves on this socket's fd: keep it open for the whole job
            port = sock.getsockname()[1]
            store = dist.TCPStore(master_addr, port, None, True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=sock.fileno())
            store.set("hetrain/nonce", uuid.uuid4().hex)
        else:
            port = cfg.master_port
            store = dist.TCPStore(master_addr, port, None, False, timeout=timeout)
        if cfg.assign_node_rank:
            node_rank = 0 if hosting else int(store.add("hetrain/nodes", 1))
            if node_rank >= cfg.cluster.nnodes:
                raise UserError(f"node {node_rank + 1} joined a job of --nnodes {cfg.cluster.nnodes}; every node must "
                                "give the same --nnodes, and each job its own --rdzv-endpoint / --master-port")
        return store, port, node_rank

    def _run(self, cluster: ClusterSpec) -> int:
        cfg = self.cfg
        topo = build_topology(cluster, cfg.comm.mode)
        master_addr = cfg.master_addr or (self.netns.host_address if self.netns else topo.procs[0].machine.address)
        embedded = cfg.node_rank is None and not cfg.assign_node_rank
        # one launcher starts every process (the whole cluster here, or a one-node job):
        # it can make up the secret; several nodes must share one
        alone = embedded or cluster.nnodes == 1
        secret = cfg.secret or os.environ.get("HETRAIN_SECRET") or (new_secret() if alone else None)
        if secret is None:
            raise UserError("a multi-node launch needs the same secret on every node: set HETRAIN_SECRET or --secret-file")
        import torch.distributed as dist  # deferred: `hetrain --help` stays fast

        timeout = timedelta(seconds=max(cfg.comm.timeout_s, 30))
        store, port, node_rank = self._open_store(dist, master_addr, timeout)
        self.store = store
        if cfg.assign_node_rank:  # this node's rank is known only now: check its GPUs before starting anything
            preflight(cluster, topo, cfg.comm, node_rank)
        local = self._local(topo, node_rank)
        cores = self._cores(topo, node_rank)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        node = "" if embedded else f"node {node_rank} of {cluster.nnodes} "
        self._log(f"hetrain: job {self.job_id}, mode {cfg.comm.mode}, {len(topo.workers)} workers + "
                  f"{len(topo.servers)} summation servers; {node or 'this node '}starts {len(local)} processes; "
                  f"logs in {self.run_dir}")
        if cores.pinned:
            self._log(f"hetrain: {describe_cores(cores, local)}")
        if STOP_REQUESTED.is_set():  # asked to stop before any process started: nothing ran, nothing to save
            self._log("hetrain: stop requested before the job started; relaunch to run it")
            return EXIT_STOPPED
        self._core_plan = cores
        for local_rank, p in enumerate(local):
            env = process_env(cfg, p, topo.world_size, cluster, master_addr, port, self.job_id, secret,
                              str(self.run_dir), self.ratelimit_dir, local_rank=local_rank,
                              local_world_size=len(local), threads=cores.threads_for(p.rank))
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
        plan = getattr(self, "_core_plan", None)
        if plan is not None and plan.cores_for(p.rank):  # the cluster file gave this worker its own cores
            argv = pin(argv, plan.cores_for(p.rank))
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

    def _pump(self, child: Child, idle_s: float = 0.2) -> None:
        """Forward a process's output as it arrives, one line per `\n`- or `\r`-ended
        piece: progress bars redraw with `\r`, so each redraw shows as its own line while
        the job runs. Output is read in chunks, not lines (a bar ends its line only when
        it closes); a piece with no end yet (a bar waiting for its next redraw) is shown
        once nothing more has arrived for `idle_s`."""
        prefix = f"[{child.proc.rank}:{child.proc.label}]"

        def emit(piece: str) -> None:
            if piece.strip():
                child.tail.append(piece)
                if not self.cfg.quiet:
                    self._log(f"{prefix} {piece}")

        stream = child.popen.stdout
        if not hasattr(stream, "fileno"):  # a remote process (Ray) hands over its output line by line
            for line in stream:
                for piece in re.split(r"[\r\n]", line if isinstance(line, str) else line.decode(errors="replace")):
                    emit(piece)
            return
        fd = stream.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        pending, shown = "", 0  # text after the last line end, and how much of it is already shown
        while True:
            if len(pending) > shown and not poller.poll(int(idle_s * 1000)):
                emit(pending[shown:])
                shown = len(pending)
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            pieces = re.split(r"[\r\n]", pending + decoder.decode(data))
            pending = pieces.pop()
            if pieces:
                emit(pieces[0][shown:])
                for piece in pieces[1:]:
                    emit(piece)
                shown = 0
        emit(pending[shown:] + decoder.decode(b"", final=True))

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
                    if self._joined(c.proc.rank):
                        self._log(f"hetrain: {topo.describe(c.proc.rank)} failed ({self._exit_text(c)}); "
                                  f"waiting up to {self.cfg.comm.timeout_s:.0f}s for the others to stop")
                        deadline = time.monotonic() + self.cfg.comm.timeout_s + 5
                    else:  # the others are waiting for it at the rendezvous: nothing to wait for
                        self._log(f"hetrain: {topo.describe(c.proc.rank)} exited ({self._exit_text(c)}) before "
                                  "the job formed; stopping the others now")
                        self._stop_all(grace=3.0)
            if first is None and running and self._workers_left_without_joining():
                self._log("hetrain: every worker finished without joining the job (the script never called "
                          "hetrain.init()); stopping the summation servers")
                self._stop_all(grace=3.0)
                break
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

    def _joined(self, rank: int) -> bool:
        """Whether `rank` got past the rendezvous (hetrain.init() marks it in the store);
        True when the store cannot say, so the ordinary timeout applies."""
        try:
            return bool(self.store.check([f"hetrain/joined/{rank}"]))
        except Exception:
            return True

    def _workers_left_without_joining(self) -> bool:
        workers = [c for c in self.children if c.proc.role == "worker"]
        if not workers or any(c.popen.returncode is None for c in workers) or self._server_check_done:
            return False
        self._server_check_done = True  # asked once, when the last worker has ended
        servers = any(c.proc.role == "server" and c.popen.returncode is None for c in self.children)
        return servers and all(c.popen.returncode in (0, EXIT_STOPPED) for c in workers) and \
            not any(self._joined(c.proc.rank) for c in workers)

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
                job_id: str, secret: str, run_dir: str, ratelimit_dir: str | None = None, *,
                local_rank: int = 0, local_world_size: int = 1, threads: int | None = None) -> dict[str, str]:
    """hetrain's variables for one process of a job, to lay over the environment of the
    machine it runs on (`full_env`). The one place that says what a process is told.
    `local_rank`/`local_world_size`: its place among the processes its launcher starts
    (torchrun's LOCAL_RANK); `threads`: the cores the cluster file gives it."""
    env = dict(cfg.extra_env)
    env.update(ProcEnv(p.rank, world_size, master_addr, port, job_id, cluster.model_dump_json(), cfg.comm,
                       run_dir, local_rank=local_rank, local_world_size=local_world_size).to_environ(secret))
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
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
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec, bufsize=0)
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
