"""The single launcher: start every worker and summation server of a cluster.

Locally it runs the whole cluster on this host (an *embedded* cluster). Across
machines, the same command runs on each node with `--node-rank` and the master's
address, torchrun-style: node 0 hosts the torch.distributed TCPStore (bound to the
cluster address only) and every process rendezvouses through it; node 0's launcher
decides each round of the job and the others follow (`rounds.py`). The launcher
streams each process's output with a rank prefix.

It watches every process of a round: exits (its own children), heartbeats in the
store (every rank, `heartbeat.py`) and the kernel's process state (its children).
The root cause of a failure is the first process that died without having lost a
peer, or one that stopped answering (no heartbeat for the peer timeout, or stopped
by a signal); the launcher records it in the store so every survivor names it,
stops a hung one, and gives the rest a grace period to stop. With `--max-restarts N`
it then starts a new round from the last commit (`hetrain.train.elastic`) on the
machines still in (`supervisor.py`); otherwise it returns non-zero with the failing
rank's error.

It fails fast, in the user's terms: a script or module that does not exist, or
workers that ask for more cores than the host has, are refused before anything starts;
a process that exits before the job has formed (before the rendezvous completes) ends
the round at once, since the others would only wait for it. Output is read in chunks
as it arrives, so a progress bar's carriage-return redraws show while the job runs.
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
from .env import CommConfig, ProcEnv, round_prefix
from .heartbeat import Heartbeat, Liveness
from .netif import iface_for_address
from .rounds import (COMMITS, JOB, JOINS, NODE_HB, RESIZE, TEARDOWN, JoinRequest, dead_key, join_key, latest_round,
                     post_exit, publish_round, read_exit, round_machines)
from .supervisor import ElasticConfig, Membership
from .topology import Proc, Topology, build_topology

EXIT_STOPPED = 3  # a process stopped at a checkpoint because it was asked to (SIGUSR1)
EXIT_RESIZE = 4  # workers stopped at a commit so that the launcher can change the job's machines
# a survivor failed because it lost a peer, and no root cause is known yet: look this
# long for the process that died or hangs before blaming the survivor itself
CONSEQUENCE_WAIT_S = 5.0


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
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

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


def _listen_fd_backend() -> dict:
    """TCPStore arguments for serving on a socket of ours (`master_listen_fd`): the libuv
    backend, PyTorch's default from 2.4, takes such a socket only from 2.8 on; before
    that the classic backend (`use_libuv=False`, a parameter since 2.2) does."""
    import torch

    version = torch.torch_version.TorchVersion(torch.__version__)
    return {"use_libuv": False} if "2.2" <= version < "2.8" else {}


def _is_local_address(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback or iface_for_address(addr) is not None
    except ValueError:
        return False


# what a process prints when it failed only because it lost a peer: hetrain's own error,
# and gloo's when its I/O thread aborts the process on a dropped connection
_LOST_PEER = ("PeerLostError", "Connection closed by peer", "Connection reset by peer", "gloo::IoException")


def _is_consequence(child: "Child") -> bool:
    return any(sign in line for line in child.tail for sign in _LOST_PEER)


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
        self._print_lock = threading.Lock()
        self.run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{self.job_id}")
        # one launcher starts every process (the whole cluster here, or a one-node job)
        self.embedded = cfg.node_rank is None and not cfg.assign_node_rank or cfg.cluster.nnodes == 1
        self.multinode = not self.embedded  # node 0 leads the rounds, the others follow
        self.node_rank = cfg.node_rank  # known once the store is open when nodes take ranks on arrival
        self.my_machines: set[str] = set()
        self.store = None
        self._job_over = False

    # ---- public -------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        cluster = cfg.cluster
        # refused before anything starts (no namespace, store or process)
        check_entry_point(cfg.argv)
        if not cfg.assign_node_rank:
            topo = build_topology(cluster, cfg.comm.mode)
            self._cores(self._local(topo, cfg.node_rank))
            preflight(cluster, topo, cfg.comm, cfg.node_rank)  # the GPUs and NCCL this node's machines ask for
        emulate = cluster.network.emulate
        if emulate == "auto":
            from ..cluster.netns import netns_available
            emulate = "netns" if netns_available() is None and self.embedded else "ratelimit"
        self.ratelimit_dir = None
        if emulate == "ratelimit":
            import tempfile
            self.ratelimit_dir = tempfile.mkdtemp(prefix=f"hetrain-{self.job_id}-",
                                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        if emulate == "netns":
            if not self.embedded:
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
            self._end_job(130)  # followers stop too if the leader is interrupted
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
    def _local(topo: Topology, node_rank: int | None) -> list[Proc]:
        """The processes of `topo` a launcher of `node_rank` starts (None: all), in rank order."""
        return [p for p in topo.procs if node_rank is None or p.machine.node == node_rank]

    def _cores(self, local: list[Proc]):
        """Cores of this host for the workers that declare `threads:` (raises when they do not fit)."""
        return assign_cores(local, sorted(os.sched_getaffinity(0)))

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
                                  master_listen_fd=sock.fileno(), **_listen_fd_backend())
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
        self.master_addr = cfg.master_addr or (self.netns.host_address if self.netns else cluster.workers[0].address)
        # one launcher starting every process can make up the secret; several nodes must share one
        secret = cfg.secret or os.environ.get("HETRAIN_SECRET") or (new_secret() if self.embedded else None)
        if secret is None:
            raise UserError("a multi-node launch needs the same secret on every node: set HETRAIN_SECRET or --secret-file")
        self.secret = secret
        import torch.distributed as dist  # deferred: `hetrain --help` stays fast

        store, self.port, node_rank = self._open_store(dist, self.master_addr,
                                                       timedelta(seconds=cfg.comm.rendezvous_timeout_s))
        self.store = store
        self.node_rank = None if self.embedded else node_rank
        if cfg.assign_node_rank:  # this node's rank is known only now: check its GPUs before starting anything
            preflight(cluster, build_topology(cluster, cfg.comm.mode), cfg.comm, node_rank)
        self.my_machines = {m.name for m in cluster.machines if self.node_rank is None or m.node == self.node_rank}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        return self._lead() if self.node_rank in (None, 0) else self._follow()

    def _child(self, p: Proc, topo: Topology, sub: ClusterSpec, r: int, local_rank: int, local_world_size: int,
               cores) -> Child:
        """Start process `p` of round `r` (`_spawn`) and forward its output."""
        env = process_env(self.cfg, p, topo.world_size, sub, self.master_addr, self.port, self.job_id, self.secret,
                          str(self.run_dir), self.ratelimit_dir, local_rank=local_rank,
                          local_world_size=local_world_size, threads=cores.threads_for(p.rank), restart=r)
        self._core_plan = cores
        child = Child(p, self._spawn(p, process_args(self.cfg, p), env))
        child.reader = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.reader.start()
        return child

    def _spawn(self, p: Proc, args: list[str], env: dict[str, str]):
        """Start one process of the job here; returns its Popen (or a handle like it:
        the Ray backend starts it in an actor)."""
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

    @staticmethod
    def _host_pid(child: Child) -> int | None:
        """The process id on this host, whose kernel state the launcher can read (None
        for a process started elsewhere, such as in a Ray actor)."""
        return child.popen.pid if isinstance(child.popen, subprocess.Popen) else None

    def _start_round(self, r: int, sub: ClusterSpec, topo: Topology):
        """This node's processes of round r; returns the round's store."""
        import torch.distributed as dist

        rstore = dist.PrefixStore(round_prefix(r), self.store)
        local = [p for p in topo.procs if p.machine.name in self.my_machines]
        cores = self._cores(local)
        if cores.pinned and r == 0:
            self._log(f"hetrain: {describe_cores(cores, local)}")
        self.children = [self._child(p, topo, sub, r, i, len(local), cores) for i, p in enumerate(local)]
        if STOP_REQUESTED.is_set():  # asked before the processes existed
            self._forward()
        return rstore

    # ---- node 0: decide the rounds ------------------------------------------------------
    def _lead(self) -> int:
        cfg, el = self.cfg, self.cfg.elastic
        self.membership = Membership(self.cluster, el, probe=self._probe)
        self._joins_seen, self._join_missing_since = 0, None
        self.node_instance: dict[int, str] = {}
        self._nodes_ever: set[int] = set()
        self.node_live = None
        if self.multinode:
            self._await_nodes()
        restarts, r = 0, 0
        while True:
            back = self.membership.ready_to_return() if r > 0 else []
            if back:
                self.membership.readmit(back)
                self._log(f"hetrain: machine(s) {', '.join(back)} healthy again: back in the job")
            try:
                sub = self.membership.next_cluster()
                topo = build_topology(sub, cfg.comm.mode)
            except UserError as err:
                self._log(f"hetrain: job failed: no usable cluster without the machines left out "
                          f"({', '.join(self.membership.left_out())}): {err}")
                return self._end_job(1)
            if len(topo.workers) < el.min_workers:
                self._log(f"hetrain: job failed: {len(topo.workers)} worker machine(s) left "
                          f"({', '.join(p.machine.name for p in topo.workers)}), fewer than --min-workers "
                          f"{el.min_workers}; left out: {', '.join(self.membership.left_out())}")
                return self._end_job(1)
            if r == 0 and STOP_REQUESTED.is_set():  # asked to stop before any process started: nothing to save
                self._log("hetrain: stop requested before the job started; relaunch to run it")
                return self._end_job(EXIT_STOPPED)
            names = [m.name for m in sub.machines]
            # the round's admission nonce exists before any of its processes asks for it
            self.store.set(f"{round_prefix(r)}/hetrain/nonce", uuid.uuid4().hex)
            if self.multinode:
                publish_round(self.store, r, names)
            rstore = self._start_round(r, sub, topo)
            what = (f"mode {cfg.comm.mode}, {len(topo.workers)} workers + {len(topo.servers)} summation servers "
                    f"on {', '.join(names)}")
            if r == 0:
                node = "this node " if self.embedded else f"node 0 of {self.cluster.nnodes} "
                self._log(f"hetrain: job {self.job_id}, {what}; {node}starts {len(self.children)} processes; "
                          f"logs in {self.run_dir}")
            else:
                self._log(f"hetrain: round {r}: {what}")
            last_chance = restarts >= el.max_restarts
            res = self._monitor(r, rstore, topo, names, last_chance)
            culprit = res.culprit.machine.name if res.culprit else None
            if res.commits:
                self.membership.progressed(names, culprit)
            if res.kind == "done":
                self._log(f"hetrain: all {len(topo.procs)} processes finished")
                return self._end_job(0)
            if res.kind == "stopped":
                self._log("hetrain: job stopped at a checkpoint on request; relaunch to resume")
                return self._end_job(EXIT_STOPPED)
            if res.kind == "resize":
                back = self.membership.ready_to_return()
                self.membership.readmit(back)
                self._log(f"hetrain: workers stopped at a commit for {', '.join(res.joining) or 'a membership change'}"
                          " to join; starting the next round")
                r += 1
                continue
            note = self.membership.blame(culprit, res.record) if culprit else None
            if last_chance or STOP_REQUESTED.is_set():
                tail = "\n".join(f"    {line}" for line in res.tail[-15:])
                why = "" if not el.elastic else (" (stop requested)" if STOP_REQUESTED.is_set()
                                                 else f" after {restarts} restart(s) (--max-restarts {el.max_restarts})")
                self._log(f"hetrain: job failed{why}: {res.culprit_text}." + (f" Its last output:\n{tail}" if tail else ""))
                return self._end_job(1)
            restarts += 1
            r += 1
            self._log(f"hetrain: restart {restarts} of {el.max_restarts}: starting round {r} from the last commit"
                      + (f"; {note}" if note else ""))

    def _await_nodes(self) -> None:
        """Round 0 starts when every node's launcher joined, or after the rendezvous
        timeout without the missing ones (they join later, at a commit)."""
        wait_s = max(60.0, self.cfg.comm.timeout_s)
        end = time.monotonic() + wait_s
        want = set(range(1, self.cluster.nnodes))
        while set(self.node_instance) < want and time.monotonic() < end:
            self._scan_joins()
            time.sleep(0.2)
        for node in sorted(want - set(self.node_instance)):
            self.membership.node_lost(node)
            self._log(f"hetrain: node {node}'s launcher did not join within {wait_s:.0f} s; starting without its "
                      "machines (they join when it connects)")

    def _scan_joins(self) -> None:
        """Admit node launchers that prove the job secret; report any that do not."""
        from .auth import check_join

        n = int(self.store.add(JOINS, 0))
        nonce = self.store.get("hetrain/nonce").decode()
        while self._joins_seen < n:
            k = join_key(self._joins_seen)
            if not self.store.check([k]):  # counted but not written yet: look again soon
                self._join_missing_since = self._join_missing_since or time.monotonic()
                if time.monotonic() - self._join_missing_since < 5:
                    return
                self._joins_seen += 1
                continue
            self._joins_seen += 1
            self._join_missing_since = None
            req = JoinRequest.loads(self.store.get(k))
            if req is None or not check_join(self.secret, nonce, req.node, req.instance, req.proof):
                self._log(f"hetrain: refused a process that asked to join the job as node {getattr(req, 'node', '?')}: "
                          "it does not prove this job's secret (HETRAIN_SECRET / --secret-file); the job goes on "
                          "without it")
                continue
            if not 1 <= req.node < self.cluster.nnodes:
                self._log(f"hetrain: refused a launcher that asked to join as node {req.node}: this job's nodes are "
                          f"0..{self.cluster.nnodes - 1} and node 0 leads it")
                continue
            connected = req.node in self.node_instance
            self.node_instance[req.node] = req.instance
            if self.node_live is None:
                self.node_live = Liveness(self.store, [], keyfmt=NODE_HB)
            self.node_live.track(req.node)
            self.membership.node_back(req.node)
            if not connected:
                seen = req.node in self._nodes_ever
                self._nodes_ever.add(req.node)
                self._log(f"hetrain: node {req.node}'s launcher {'reconnected' if seen else 'joined'}")

    def _watch_nodes(self) -> list[int]:
        """Nodes whose launcher stopped beating for the peer timeout: their machines
        are out until it reconnects."""
        if self.node_live is None:
            return []
        self.node_live.poll()
        lost = self.node_live.hung(self.cfg.comm.timeout_s)
        for node in lost:
            self.node_live.forget(node)
            self.node_instance.pop(node, None)
            self.membership.node_lost(node)
            self._log(f"hetrain: node {node}'s launcher stopped answering for {self.cfg.comm.timeout_s:.0f} s; "
                      "its machines are out until it reconnects")
        return lost

    def _probe(self, name: str) -> bool:
        """Independent evidence that a left-out machine of this host works again."""
        if self.netns is not None:
            return self.netns.link_up(name)
        return True

    def _pending(self, names: list[str]) -> list[str]:
        """Machines that should join the running round at its next commit."""
        want = set(self.membership.included()) | set(self.membership.ready_to_return())
        return sorted(want - set(names))

    def _monitor(self, r: int, rstore, topo: Topology, names: list[str], last_chance: bool) -> "RoundResult":
        hang_s = self.cfg.comm.timeout_s
        suspect_s = min(hang_s, max(3.0, hang_s / 3))
        local = {c.proc.rank: c for c in self.children}
        remote = [p.rank for p in topo.procs if p.rank not in local]
        live = Liveness(rstore, [p.rank for p in topo.procs])
        for c in self.children:
            if self._host_pid(c) is not None:
                live.watch_pid(c.proc.rank, self._host_pid(c))
        exits: dict[int, tuple[int, bool]] = {}
        texts: dict[int, str] = {}  # how a process of this node ended, in words

        def how(k: int) -> str:
            return texts.get(k) or _describe_exit(exits[k][0])

        never_joined_checked = False
        root: tuple[int, str] | None = None
        consequence_since = None
        deadline = None
        joining: list[str] = []
        next_poll = 0.0
        while True:
            now = time.monotonic()
            for rank, c in local.items():
                if rank not in exits and c.popen.poll() is not None:
                    if c.reader:
                        c.reader.join(timeout=2)  # its last lines decide whether it only lost a peer
                    exits[rank] = (c.popen.returncode, _is_consequence(c))
                    texts[rank] = self._exit_text(c)
                    live.forget(rank)
            if now >= next_poll:
                next_poll = now + 0.5
                live.poll()
                for rank in remote:
                    if rank not in exits:
                        e = read_exit(rstore, rank)
                        if e is not None:
                            exits[rank] = e
                            live.forget(rank)
                self._scan_joins()
                for node in self._watch_nodes():
                    for p in topo.procs:
                        if p.machine.node == node and p.rank not in exits:
                            exits[p.rank] = (-signal.SIGKILL, False)
                            live.forget(p.rank)
                # a machine may join at a commit, but only once this round has made progress
                # of its own (two commits: its first is where it resumed), so machines that
                # come and go cannot keep the job restarting without training
                if root is None and not joining and self.cfg.elastic.elastic and int(rstore.add(COMMITS, 0)) >= 2:
                    joining = self._pending(names)
                    if joining:
                        rstore.set(RESIZE, ",".join(joining))
                        self._log(f"hetrain: {', '.join(joining)} can join; asking the workers to stop at their next "
                                  "commit")
            if root is None:
                failed = {k: e for k, e in exits.items() if e[0] not in (0, EXIT_STOPPED, EXIT_RESIZE)}
                real = [k for k, (_, cons) in failed.items() if not cons]  # in the order they were seen
                hung = live.hung(hang_s)
                if real:
                    root = (real[0], f"died: {how(real[0])}")
                elif hung:
                    root = (hung[0], f"hung: {live.reason(hung[0])}")
                elif failed:
                    consequence_since = consequence_since or now
                    suspects = live.hung(suspect_s)
                    if suspects:
                        root = (suspects[0], f"hung: {live.reason(suspects[0])}")
                    elif now - consequence_since > CONSEQUENCE_WAIT_S:
                        k = min(failed)
                        root = (k, f"died: {how(k)}")
                if root is not None:
                    rank, record = root
                    try:
                        rstore.set(dead_key(rank), record)
                    except Exception:
                        pass
                    kind, _, how = record.partition(": ")
                    grace = hang_s + 5 if last_chance else min(hang_s, 5.0)
                    if kind == "hung":
                        self._log(f"hetrain: {topo.describe(rank)} stopped answering: {how}; stopping it")
                        if rank in local:
                            self._signal(local[rank], signal.SIGKILL)
                    elif not _joined(rstore, rank):  # the others wait for it at the rendezvous: nothing to wait for
                        self._log(f"hetrain: {topo.describe(rank)} exited ({how}) before the job formed; stopping "
                                  "the others now")
                        grace = 0.0
                    else:
                        self._log(f"hetrain: {topo.describe(rank)} failed ({how}); waiting up to {grace:.0f}s for "
                                  "the others to stop")
                    deadline = now + grace
            if root is None and not never_joined_checked and all(w in exits for w in topo.worker_ranks):
                never_joined_checked = True  # asked once, when the last worker has ended
                workers_ok = all(exits[w][0] in (0, EXIT_STOPPED) for w in topo.worker_ranks)
                if workers_ok and len(exits) < len(topo.procs) and \
                        not any(_joined(rstore, w) for w in topo.worker_ranks):
                    self._log("hetrain: every worker finished without joining the job (the script never called "
                              "hetrain.init()); stopping the summation servers")
                    self._stop_all(grace=3.0)
                    if remote:
                        self._teardown_remote(rstore, remote, exits)
                    for k in range(len(topo.procs)):
                        exits[k] = (0, False) if k not in topo.worker_ranks else exits[k]
            if len(exits) == len(topo.procs):
                break
            if deadline is not None and now > deadline:
                if any(c.popen.poll() is None for c in self.children):
                    self._log("hetrain: some processes did not stop in time; terminating them")
                self._stop_all(grace=3.0)
                if remote:
                    self._teardown_remote(rstore, remote, exits)
                break
            time.sleep(0.1)
        for c in self.children:
            if c.reader:
                c.reader.join(timeout=5)
        failed = {k: e for k, e in exits.items() if e[0] not in (0, EXIT_STOPPED, EXIT_RESIZE, -signal.SIGTERM)}
        if root is None and failed:
            k = min(failed, key=lambda k: (failed[k][1], k))
            root = (k, f"died: {how(k)}")
        try:
            commits = int(rstore.add(COMMITS, 0))
        except Exception:
            commits = 0
        res = RoundResult(names=names, commits=commits, joining=joining)
        if root is not None:
            rank, record = root
            kind, _, how = record.partition(": ")
            res.kind, res.culprit, res.record = "failed", topo.proc(rank), record
            res.culprit_text = f"{topo.describe(rank)} ({'stopped answering: ' if kind == 'hung' else ''}{how})"
            res.tail = list(local[rank].tail) if rank in local else []
        else:
            codes = {e[0] for e in exits.values()}
            res.kind = "resize" if EXIT_RESIZE in codes else "stopped" if EXIT_STOPPED in codes else "done"
        return res

    def _teardown_remote(self, rstore, remote: list[int], exits: dict) -> None:
        """Ask the other nodes' launchers to stop this round's processes; wait a little."""
        try:
            rstore.set(TEARDOWN, "1")
        except Exception:
            return
        end = time.monotonic() + 10
        while time.monotonic() < end and any(k not in exits for k in remote):
            for k in remote:
                if k not in exits:
                    e = read_exit(rstore, k)
                    if e is not None:
                        exits[k] = e
            time.sleep(0.2)

    def _end_job(self, rc: int) -> int:
        """Tell the other nodes' launchers the job is over (once)."""
        if not self._job_over and self.store is not None and self.multinode and self.node_rank in (None, 0):
            self._job_over = True
            try:
                self.store.set(JOB, str(rc))
                # the store lives in this process: keep it up until the connected nodes read the end
                nodes = list(getattr(self, "node_instance", {}))
                end = time.monotonic() + 10
                while nodes and time.monotonic() < end:
                    nodes = [k for k in nodes if not self.store.check([f"{JOB}/ack/{k}"])]
                    time.sleep(0.1)
            except Exception:
                pass
        self._job_over = True
        return rc

    # ---- other nodes: follow the leader's rounds ---------------------------------------
    def _follow(self) -> int:
        from .auth import join_tag

        cfg, store = self.cfg, self.store
        node = self.node_rank
        instance = uuid.uuid4().hex[:12]
        nonce = store.get("hetrain/nonce").decode()

        def join() -> None:
            i = int(store.add(JOINS, 1)) - 1
            store.set(join_key(i), JoinRequest(node, instance, join_tag(self.secret, nonce, node, instance)).dumps())

        join()
        beat = Heartbeat(self.master_addr, self.port, "", node, keyfmt=NODE_HB).start()
        self._log(f"hetrain: node {node} joined job at {self.master_addr}:{self.port}; waiting for rounds")
        store.set_timeout(timedelta(seconds=10))
        current, rstore, posted = -1, None, set()
        lost_since = None
        left_out_since = None  # none of this node's machines runs: the leader may have dropped it
        try:
            while True:
                try:
                    if store.check([JOB]):
                        rc = int(store.get(JOB).decode())
                        store.set(f"{JOB}/ack/{node}", "1")
                        self._stop_all(grace=3.0)
                        self._log(f"hetrain: the job ended (exit code {rc})")
                        return rc
                    latest = latest_round(store)
                    if latest > current:
                        if self.children:
                            self._stop_all(grace=3.0)
                            self._post_exits(rstore, posted)
                        current = latest
                        sub = self.cluster.subset(round_machines(store, current))
                        topo = build_topology(sub, cfg.comm.mode)
                        posted = set()
                        rstore = self._start_round(current, sub, topo)
                        self._log(f"hetrain: round {current}: node {node} of {self.cluster.nnodes} starts "
                                  f"{len(self.children)} processes")
                        left_out_since = None if self.children else time.monotonic()
                    if left_out_since is not None and time.monotonic() - left_out_since > 2 * cfg.comm.timeout_s:
                        join()  # e.g. after a partition healed: prove the secret again to be counted
                        left_out_since = time.monotonic()
                    if rstore is not None:
                        self._post_exits(rstore, posted)
                        for c in self.children:
                            if c.popen.poll() is None and rstore.check([dead_key(c.proc.rank)]):
                                if rstore.get(dead_key(c.proc.rank)).decode().startswith("hung"):
                                    self._signal(c, signal.SIGKILL)
                        if any(c.popen.poll() is None for c in self.children) and rstore.check([TEARDOWN]):
                            self._stop_all(grace=3.0)
                            self._post_exits(rstore, posted)
                    lost_since = None
                except (RuntimeError, OSError) as err:  # the store (node 0) is unreachable
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since > max(cfg.comm.timeout_s, 30):
                        self._log(f"hetrain: lost the job's master at {self.master_addr}:{self.port} ({err}); "
                                  "stopping this node's processes")
                        self._stop_all(grace=3.0)
                        return 1
                time.sleep(0.3)
        finally:
            beat.stop(join_s=beat.timeout_s + 1.0)  # gone before the interpreter finalises (Heartbeat.stop)

    def _post_exits(self, rstore, posted: set) -> None:
        for c in self.children:
            if c.proc.rank not in posted and c.popen.poll() is not None:
                if c.reader:
                    c.reader.join(timeout=2)
                post_exit(rstore, c.proc.rank, c.popen.returncode, _is_consequence(c))
                posted.add(c.proc.rank)

    # ---- output and teardown ------------------------------------------------------------
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


@dataclass
class RoundResult:
    kind: str = "done"  # done | stopped | resize | failed
    culprit: Proc | None = None
    record: str = ""  # "died: how" | "hung: why"
    culprit_text: str = ""
    tail: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    commits: int = 0
    joining: list[str] = field(default_factory=list)


def _joined(rstore, rank: int) -> bool:
    """Whether `rank` got past the rendezvous (hetrain.init() marks it in the round's
    store); True when the store cannot say, so the ordinary grace applies."""
    try:
        return bool(rstore.check([f"hetrain/joined/{rank}"]))
    except Exception:
        return True


def process_env(cfg: LaunchConfig, p: Proc, world_size: int, cluster: ClusterSpec, master_addr: str, port: int,
                job_id: str, secret: str, run_dir: str, ratelimit_dir: str | None = None, *,
                local_rank: int = 0, local_world_size: int = 1, threads: int | None = None,
                restart: int = 0) -> dict[str, str]:
    """hetrain's variables for one process of a job, to lay over the environment of the
    machine it runs on (`full_env`). The one place that says what a process is told.
    `local_rank`/`local_world_size`: its place among the processes its launcher starts
    (torchrun's LOCAL_RANK); `threads`: the cores the cluster file gives it; `restart`:
    the job's round (0 first, then one more per restart or resize)."""
    env = dict(cfg.extra_env)
    env.update(ProcEnv(p.rank, world_size, master_addr, port, job_id, cluster.model_dump_json(), cfg.comm,
                       run_dir, local_rank=local_rank, local_world_size=local_world_size,
                       restart=restart).to_environ(secret))
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
