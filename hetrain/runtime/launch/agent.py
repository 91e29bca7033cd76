"""The launcher of one node (or of a whole cluster on one host): sets up the job
(pre-flight checks, emulated network, signals, the rendezvous store) and runs its
rounds as the leader (node 0, `leader.py`) or a follower (`follower.py`). Its
processes are started through a `ProcessBackend` (`procs.py`)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

from ...cluster.spec import ClusterSpec
from ...errors import UserError
from .. import STOP_REQUESTED
from ..auth import new_secret
from ..cores import describe as describe_cores
from ..devices import one_host, preflight as gpu_preflight
from ..env import round_prefix
from ..shmnames import remove_job_segments
from ..topology import Proc, Topology, build_topology
from .config import LaunchConfig
from .follower import Follower
from .leader import Leader
from .output import Console, pump
from .preflight import check_entry_point, check_node, plan_cores
from .procs import Child, LocalProcesses, ProcessBackend, process_args, process_env
from .store import SCRIPT_PORT, ScriptStore, open_store

# torchrun's agent: these end the launcher, passed on to the processes, which get
# SHUTDOWN_S to stop before they are killed (`SimpleElasticAgent._shutdown`)
DEATH_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
SHUTDOWN_S = 30.0


class Launcher(Leader, Follower):
    def __init__(self, cfg: LaunchConfig, backend: ProcessBackend | None = None):
        self.cfg = cfg
        self.backend = backend or LocalProcesses()
        self.children: list[Child] = []
        self.job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.job_id)[:40] if cfg.job_id else uuid.uuid4().hex[:8]
        self.netns = None
        self.console = Console()  # progress bars in place on a terminal, plain lines in a log
        self.run_dir = Path(cfg.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{self.job_id}")
        # one launcher starts every process (the whole cluster here, or a one-node job)
        self.embedded = cfg.node_rank is None and not cfg.assign_node_rank or cfg.cluster.nnodes == 1
        self.multinode = not self.embedded  # node 0 leads the rounds, the others follow
        self.node_rank = cfg.node_rank  # known once the store is open when nodes take ranks on arrival
        self.my_machines: set[str] = set()
        self.store = None
        self._job_over = False
        self._last_note = None
        self.scripts: ScriptStore | None = None  # node 0: this round's store for the scripts' env://
        self._script_port: int | None = None
        self._death_sig: signal.Signals | None = None  # the signal that is ending the launcher

    # ---- public -------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        cluster = cfg.cluster
        # refused before anything starts (no namespace, store or process)
        check_entry_point(cfg.argv)
        note = None
        if not cfg.assign_node_rank:  # cores, and the GPUs and NCCL this node's machines ask for
            note = check_node(cluster, cfg.comm, cfg.node_rank, self.backend.gpus_here)
        self._emulation(cluster)
        old = {s: signal.getsignal(s) for s in (*DEATH_SIGNALS, signal.SIGUSR1)}
        for s in DEATH_SIGNALS:
            signal.signal(s, self._on_signal)
        signal.signal(signal.SIGUSR1, self._forward)
        try:
            if self.netns is not None:
                cluster = self.netns.up()
                self._log(f"hetrain: emulated network: {len(cluster.machines)} namespaces on bridge "
                          f"{self.netns.bridge}, tbf-shaped links, {self.netns.qdisc_used} queues")
            if note:
                self._log(f"hetrain: {note}")
            return self._run(cluster)
        finally:
            # as torchrun: the signal that ends the launcher goes on to the processes, which get
            # its shutdown timeout to act on it (a script may checkpoint on SIGTERM)
            self._stop_all(grace=3.0 if self._death_sig is None else SHUTDOWN_S, signum=self._death_sig)
            self.console.close()
            self._end_job(130)  # followers stop too if the leader is interrupted
            if self.scripts is not None:
                self.scripts.close()
            if self.netns is not None:
                self.netns.down()
            if self.ratelimit_dir:
                import shutil
                shutil.rmtree(self.ratelimit_dir, ignore_errors=True)
            remove_job_segments(self.job_id)  # shared memory a killed process could not unlink
            for s, h in old.items():
                signal.signal(s, h)

    # ---- set-up -------------------------------------------------------------------------
    def _emulation(self, cluster: ClusterSpec) -> None:
        """Decide how links are emulated: network namespaces (one host) or rate limits."""
        emulate = cluster.network.emulate
        if emulate == "auto":
            from ...cluster.netns import netns_available
            emulate = "netns" if netns_available() is None and self.embedded else "ratelimit"
        self.ratelimit_dir = None
        if emulate == "ratelimit":
            import tempfile
            self.ratelimit_dir = tempfile.mkdtemp(prefix=f"hetrain-{self.job_id}-",
                                                  dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        if emulate == "netns":
            if not self.embedded:
                raise UserError("netns emulation runs a whole cluster on one host; drop --node-rank or set emulate: none")
            from ...cluster.netns import NetnsCluster
            self.netns = NetnsCluster(cluster)
            if isinstance(self.backend, LocalProcesses):
                self.backend.netns = self.netns

    def _forward(self, signum=signal.SIGUSR1, frame=None) -> None:
        """SIGUSR1 asks the job to checkpoint and stop (elastic resizing): pass it on."""
        STOP_REQUESTED.set()
        for c in self.children:
            if c.popen.poll() is None:
                self.backend.signal(c, signum)

    def _on_signal(self, signum, frame) -> None:
        self._death_sig = signal.Signals(signum)
        raise KeyboardInterrupt(f"launcher got {signal.Signals(signum).name}")

    def _run(self, cluster: ClusterSpec) -> int:
        cfg = self.cfg
        self.master_addr = cfg.master_addr or (self.netns.host_address if self.netns else cluster.workers[0].address)
        # one launcher starting every process can make up the secret; several nodes must share one
        secret = cfg.secret or os.environ.get("HETRAIN_SECRET") or (new_secret() if self.embedded else None)
        if secret is None:
            raise UserError("a multi-node launch needs the same secret on every node: set HETRAIN_SECRET or --secret-file")
        self.secret = secret
        opened = open_store(cfg, self.master_addr, timedelta(seconds=cfg.comm.rendezvous_timeout_s))
        self._listen_sock = opened.sock  # TCPStore serves on this socket's fd: keep it open for the whole job
        self.store, self.port = opened.store, opened.port
        self.node_rank = None if self.embedded else opened.node_rank
        if cfg.assign_node_rank:  # this node's rank is known only now: check its GPUs before starting anything
            gpu_preflight(cluster, build_topology(cluster, cfg.comm.mode), cfg.comm, opened.node_rank)
        self.my_machines = {m.name for m in cluster.machines if self.node_rank is None or m.node == self.node_rank}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        return self._lead() if self.node_rank in (None, 0) else self._follow()

    # ---- rounds -------------------------------------------------------------------------
    def _start_round(self, r: int, sub: ClusterSpec, topo: Topology):
        """This node's processes of round r; returns the round's store."""
        import torch.distributed as dist

        rstore = dist.PrefixStore(round_prefix(r), self.store)
        # node 0 opened the round's store for the scripts before publishing the round
        self._script_port = self.scripts.port if self.scripts is not None else int(rstore.get(SCRIPT_PORT).decode())
        local = [p for p in topo.procs if p.machine.name in self.my_machines]
        (self.run_dir / "errors" / f"round{r}").mkdir(parents=True, exist_ok=True)  # TORCHELASTIC_ERROR_FILE's
        cores = plan_cores(local)
        if cores.pinned and r == 0:
            self._log(f"hetrain: {describe_cores(cores, local)}")
        # the processes of an embedded launch see one host (devices.one_host): GPUs are told apart by device
        view, extra = self.backend.prepare(local, sub if self.multinode else one_host(sub))
        self.children = [self._child(p, topo, view, r, i, len(local), cores, extra.get(p.rank, {}))
                         for i, p in enumerate(local)]
        if STOP_REQUESTED.is_set():  # asked before the processes existed
            self._forward()
        return rstore

    def _child(self, p: Proc, topo: Topology, view: ClusterSpec, r: int, local_rank: int, local_world_size: int,
               cores, extra: dict[str, str]) -> Child:
        """Start process `p` of round `r` (told the cluster `view`, and `extra` variables)
        and forward its output."""
        env = process_env(self.cfg, p, topo, view, self.master_addr, self.port, self.job_id, self.secret,
                          str(self.run_dir), self.ratelimit_dir, local_rank=local_rank,
                          local_world_size=local_world_size, threads=cores.threads_for(p.rank), restart=r,
                          group_rank=p.machine.node, script_port=self._script_port) | extra
        child = Child(p, self.backend.spawn(p, process_args(self.cfg, p), env, cores))
        child.reader = threading.Thread(target=pump, args=(child, self.console, self.cfg.quiet), daemon=True)
        child.reader.start()
        return child

    def _open_script_store(self, r: int) -> None:
        """Node 0: a fresh store for round r's scripts (`store.ScriptStore`), its port
        published for the other nodes before the round is."""
        if self.scripts is not None:
            self.scripts.close()
        self.scripts = ScriptStore(self.master_addr)
        self.store.set(f"{round_prefix(r)}/{SCRIPT_PORT}", str(self.scripts.port))

    # ---- output and teardown ------------------------------------------------------------
    def _log(self, text: str) -> None:
        self.console.line(text)

    def _stop_all(self, grace: float, signum: int | None = None) -> None:
        """Stop this node's processes: `signum` (SIGTERM), then SIGKILL after `grace` s."""
        alive = [c for c in self.children if c.popen.poll() is None]
        for c in alive:
            self.backend.signal(c, signum or signal.SIGTERM)
        end = time.monotonic() + grace
        for c in alive:
            try:
                c.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.backend.signal(c, signal.SIGKILL)
                c.popen.wait()
