"""How the launcher starts, signals and describes the processes of a job, behind one
interface (`ProcessBackend`), as torchrun's agent hides its process context behind
`start_processes`: `LocalProcesses` starts them on this host (pinned to cores, inside
an emulated network namespace where there is one); the Ray backend
(`runtime/ray_backend.py`) starts each in an actor on the node Ray placed its machine.

Also here: what one process is told (`process_env`, the one place that says so) and
what it runs (`process_args`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

from ...cluster.spec import ClusterSpec
from ..cores import pin
from ..devices import worker_device
from ..env import ProcEnv
from ..topology import Proc, Topology
from ..torchrun import agent_environ
from .config import LaunchConfig
from .heap import heap_env

# what a process prints when it failed only because it lost a peer: hetrain's own error,
# and gloo's when its I/O thread aborts the process on a dropped connection
_LOST_PEER = ("PeerLostError", "Connection closed by peer", "Connection reset by peer", "gloo::IoException")


@dataclass
class Child:
    """One process of the current round that this launcher started."""

    proc: Proc
    popen: subprocess.Popen  # or a handle shaped like it (the Ray backend's RemoteProcess)
    tail: deque = field(default_factory=lambda: deque(maxlen=60))
    reader: threading.Thread | None = None


def is_consequence(child: Child) -> bool:
    """Whether the process's last output says it failed only because it lost a peer."""
    return any(sign in line for line in child.tail for sign in _LOST_PEER)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessBackend:
    """Where and how the processes of a job run. Subclasses start them (`spawn`); the
    rest has a default for processes of this host."""

    gpus_here = True  # the processes use this host's GPUs (pre-flight counts them here)

    def prepare(self, procs: list[Proc], view: ClusterSpec) -> tuple[ClusterSpec, dict[int, dict[str, str]]]:
        """Before a round's processes start: the cluster as they are to see it, and extra
        variables by rank (a backend that learns their devices only once placed says so)."""
        return view, {}

    def spawn(self, p: Proc, args: list[str], env: dict[str, str], cores) -> subprocess.Popen:
        """Start process `p` with interpreter arguments `args` and hetrain's variables
        `env` (laid over the machine's environment); `cores` is this round's core plan."""
        raise NotImplementedError

    def signal(self, child: Child, signum: int) -> None:
        """Send a signal to a process and its children."""
        try:
            os.killpg(child.popen.pid, signum)
        except ProcessLookupError:
            pass

    def exit_text(self, child: Child) -> str:
        """How an ended process ended, in words."""
        return describe_exit(child.popen.returncode)

    def host_pid(self, child: Child) -> int | None:
        """The process id on this host, whose kernel state the launcher can read (None
        for a process started elsewhere, such as in a Ray actor)."""
        return child.popen.pid if isinstance(child.popen, subprocess.Popen) else None


class LocalProcesses(ProcessBackend):
    """Processes of this host: pinned to the cores the cluster file gives them, and
    inside their machine's namespace when the network is emulated (`netns`, set once
    the namespaces are up)."""

    def __init__(self) -> None:
        self.netns = None

    def spawn(self, p: Proc, args: list[str], env: dict[str, str], cores) -> subprocess.Popen:
        argv = [sys.executable, *args]
        if cores is not None and cores.cores_for(p.rank):  # the cluster file gave this worker its own cores
            argv = pin(argv, cores.cores_for(p.rank))
        if self.netns is not None:
            argv = self.netns.wrap(p.machine.name, argv)
        return start_process(argv, full_env(env))


def process_env(cfg: LaunchConfig, p: Proc, topo: Topology, cluster: ClusterSpec, master_addr: str, port: int,
                job_id: str, secret: str, run_dir: str, ratelimit_dir: str | None = None, *,
                local_rank: int = 0, local_world_size: int = 1, threads: int | None = None,
                restart: int = 0, group_rank: int = 0, script_port: int | None = None) -> dict[str, str]:
    """hetrain's variables for one process of a job, to lay over the environment of the
    machine it runs on (`full_env`). The one place that says what a process is told.
    `local_rank`/`local_world_size`: its place among the processes its launcher starts
    (torchrun's LOCAL_RANK), except that a CUDA worker's LOCAL_RANK is the index of the GPU
    it is bound to, so a script's `torch.cuda.set_device(LOCAL_RANK)` or
    `DDP(device_ids=[LOCAL_RANK])` picks that GPU (workers that share one GPU share it); `threads`: the cores the cluster file gives it; `restart`:
    the job's round (0 first, then one more per restart or resize); `group_rank`: its
    launcher's node; `script_port`: the round's store for the script's own env://
    rendezvous (`store.ScriptStore`; torchrun's variables: `torchrun.agent_environ`)."""
    env = heap_env(cfg.heap, {**os.environ, **cfg.extra_env})
    env.update(cfg.extra_env)
    device = worker_device(p)
    if device.type == "cuda":  # LOCAL_RANK names the GPU hetrain binds: set_device(LOCAL_RANK) agrees
        local_rank = device.index
    env.update(ProcEnv(p.rank, topo.world_size, master_addr, port, job_id, cluster.model_dump_json(), cfg.comm,
                       run_dir, local_rank=local_rank, local_world_size=local_world_size,
                       restart=restart).to_environ(secret))
    worker = p.role == "worker"
    env.update(agent_environ(
        group_rank=group_rank, group_world_size=cfg.cluster.nnodes, role="default" if worker else "server",
        role_rank=p.index, role_world_size=len(topo.workers if worker else topo.servers), restart=restart,
        max_restarts=cfg.elastic.max_restarts, run_id=job_id, master_port=port if script_port is None else script_port,
        error_file=os.path.join(run_dir, "errors", f"round{restart}", f"rank{p.rank}.json")))
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
    """The interpreter's arguments for one process: the user's script on workers (run as
    `python SCRIPT` would, through `hetrain.runtime.script`, which lets gloo's threads
    settle before the interpreter finalises), the summation service on servers."""
    if p.role == "worker":
        return ["-u", "-m", "hetrain.runtime.script", *cfg.argv]
    return ["-u", "-m", "hetrain.comm.server"]


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
