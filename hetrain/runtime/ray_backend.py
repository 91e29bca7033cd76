"""Run a job's processes on a Ray cluster (`hetrain launch --ray ADDRESS`).

Ray is used for what it is good at: knowing the machines, reserving GPUs and CPUs on
them atomically (a *placement group*), starting processes there and noticing when a
node or a process dies. Everything else stays the single launcher's: the rank table,
the rendezvous store (hosted by this driver, bound to its cluster address only), the
job secret, the environment of every process (`launch.process_env`), streaming the
output with rank prefixes, stop requests (SIGUSR1) and failure handling.

One bundle per machine of the cluster file: a worker machine whose device kind is of
class gpu (`ClusterSpec.kind_of`: as the file's `kinds:` describe it; a kind described
nowhere is a GPU unless it is named `cpu`) gets a GPU bundle (`gpu_resource`, 1, plus a sliver of the GPU-type resource
`accelerator_type:<KIND>` where the Ray cluster has one, so `kind: v100` lands on a
V100 node), and every bundle gets `cpus_per_process` CPUs for each process of the
machine (its worker and its co-located summation server); a CPU machine gets a CPU
bundle for its server. Each process is a small actor in its machine's bundle that
starts the rank as a child process (`launch.start_process`, so SIGUSR1 is blocked
until the script is ready, and the child dies with the actor), pipes its output back
and passes signals on. The machines' addresses in the cluster handed to the processes
are the addresses of the Ray nodes their bundles landed on, so gloo binds to the
cluster network exactly as in a local launch.

The driver talks to Ray only (no ssh); Ray's own processes must already run on every
machine (`ray start --head` / `ray start --address`). See docs/user-guide.md.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

from ..cluster.spec import ClusterSpec
from ..errors import UserError
from . import STOP_REQUESTED
from .launch import EXIT_STOPPED, Child, LaunchConfig, Launcher, ProcessBackend, full_env, start_process
from .topology import Proc, build_topology

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_LOST = -int(signal.SIGKILL)  # exit status reported for a process whose actor or node was lost


def import_ray():
    """Ray is an optional extra: a clear message where it is missing."""
    try:
        import ray
    except ImportError:
        raise UserError("running on a Ray cluster needs Ray: pip install 'hetrain[ray]'") from None
    return ray


@dataclass(frozen=True)
class RayOptions:
    """How a job asks a Ray cluster for its machines."""

    address: str = "auto"
    gpu_resource: str = "GPU"  # the Ray resource that counts GPUs (a custom one for emulated GPUs)
    gpu_type_resource: str = "accelerator_type:{KIND}"  # marks a node's GPU type ({KIND}: device kind upper-cased)
    cpus_per_process: float = 1.0
    strategy: Strategy = "PACK"
    reserve_timeout_s: float = 120.0  # waiting longer than this for the resources is an error

    def __post_init__(self) -> None:
        if self.address.startswith("ray://"):
            raise UserError(f"--ray {self.address}: Ray Client addresses are not supported: the driver hosts the "
                            "job's rendezvous store, so run `hetrain launch --ray` on a node of the cluster "
                            "(e.g. the head node) with the GCS address (HOST:6379) or `auto`")
        if self.cpus_per_process < 0:
            raise UserError(f"--ray-cpus must be >= 0, got {self.cpus_per_process}")
        if not self.gpu_resource:
            raise UserError("--ray-gpu-resource must name a Ray resource, e.g. GPU")
        if self.reserve_timeout_s <= 0:
            raise UserError("the reservation timeout must be positive")


def connect(address: str):
    """Join the Ray cluster as a driver (quietly: the job's own output is what we show)."""
    ray = import_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace="hetrain", log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=True)
        except ConnectionError as err:
            raise UserError(f"cannot reach the Ray cluster at {address!r}: {err}; start it with `ray start --head` "
                            "and pass its address (HOST:6379) or `auto` on one of its nodes") from None
    return ray


def uses_gpu(cluster: ClusterSpec, machine) -> bool:
    """Whether a machine's process needs a GPU of Ray: a worker whose kind is a GPU kind."""
    return machine.role == "worker" and cluster.kind_of(machine).device_class == "gpu"


def gpu_type_of(cluster: ClusterSpec, machine) -> str | None:
    """A GPU worker's GPU type: its device kind's name (`gpu`: any GPU, no type)."""
    kind = cluster.kind_of(machine)
    return None if kind.device_class == "cpu" or kind.name == "gpu" else kind.name


def machine_bundles(cluster: ClusterSpec, mode: str, opts: RayOptions,
                    cluster_resources: dict[str, float]) -> tuple[list[dict[str, float]], dict[str, int]]:
    """Placement-group bundles, one per machine that runs a process, and machine -> bundle index."""
    topo = build_topology(cluster, mode)
    bundles: list[dict[str, float]] = []
    index: dict[str, int] = {}
    for m in cluster.machines:
        nprocs = sum(1 for p in topo.procs if p.machine.name == m.name)
        if nprocs == 0:
            continue
        b: dict[str, float] = {}
        if opts.cpus_per_process > 0:
            b["CPU"] = opts.cpus_per_process * nprocs
        if uses_gpu(cluster, m):
            b[opts.gpu_resource] = 1.0
            kind = gpu_type_of(cluster, m)
            if kind:
                marker = opts.gpu_type_resource.format(KIND=kind.upper(), kind=kind)
                if marker not in cluster_resources:
                    have = sorted(r for r in cluster_resources if r.startswith(opts.gpu_type_resource.split("{")[0]))
                    raise UserError(f"machine {m.name} asks for a {kind} GPU but no node of the Ray cluster has the "
                                    f"resource {marker!r} (GPU types there: {have or 'none'}); write `kind: gpu` "
                                    f"for any GPU, or start the nodes with that resource")
                b[marker] = 0.001
        if not b:
            b["CPU"] = 0.001  # a bundle needs some resource
        index[m.name] = len(bundles)
        bundles.append(b)
    return bundles, index


class _RankProcess:
    """Actor (threaded) that runs one process of the job on its node."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lines: deque = deque()
        self.cond = threading.Condition()
        self.code: int | None = None
        self.pending: list[int] = []  # signals that came before the process existed

    def where(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def start(self, args: list[str], env: dict[str, str], cwd: str) -> int:
        if not os.path.isdir(cwd):
            raise UserError(f"working directory {cwd} does not exist on this node; hetrain runs the script from the "
                            "same path on every node (a shared file system or the same image)")
        started = threading.Event()
        failed: list[BaseException] = []

        def supervise() -> None:
            # the child dies with this thread's process (PR_SET_PDEATHSIG), which lives as long as the child
            try:
                proc = start_process([sys.executable, *args], full_env(env), cwd=cwd, die_with_parent=True)
            except BaseException as err:  # noqa: BLE001 - reported to the caller
                failed.append(err)
                started.set()
                return
            with self.cond:
                self.proc, pending = proc, list(self.pending)
            for signum in pending:  # e.g. a stop request that raced the start (SIGUSR1 stays pending in the child)
                self.signal(signum)
            started.set()
            for raw in self.proc.stdout:
                with self.cond:
                    self.lines.append(raw)
                    self.cond.notify_all()
            code = self.proc.wait()
            with self.cond:
                self.code = code
                self.cond.notify_all()

        threading.Thread(target=supervise, daemon=True).start()
        started.wait()
        if failed:
            raise failed[0]
        return self.proc.pid

    def read(self, timeout: float) -> tuple[list[bytes], int | None]:
        """New output lines, and the exit status once the process ended and all output was read."""
        with self.cond:
            self.cond.wait_for(lambda: self.lines or self.code is not None, timeout)
            out = list(self.lines)
            self.lines.clear()
            return out, self.code

    def signal(self, signum: int) -> None:
        with self.cond:
            if self.proc is None:
                self.pending.append(signum)
                return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass


class RemoteProcess:
    """Driver-side handle of a rank running in an actor, shaped like the Popen the
    launcher watches: `stdout` yields its output lines, `poll`/`wait`/`returncode`."""

    def __init__(self, ray, actor, start_ref, node_ip: str) -> None:
        self._ray = ray
        self.actor = actor
        self._start_ref = start_ref
        self.node_ip = node_ip
        self.returncode: int | None = None
        self.lost: str | None = None
        self._done = threading.Event()

    @property
    def stdout(self):
        return self._lines()

    def _finish(self, code: int, lost: str | None = None) -> None:
        self.lost = lost
        self.returncode = code
        self._done.set()

    def _lines(self):
        ray = self._ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            ray.get(self._start_ref)
        except RayTaskError as err:
            cause = err.cause if getattr(err, "cause", None) else err
            yield f"hetrain: could not start the process on node {self.node_ip}: {cause}\n".encode()
            self._finish(1)
            return
        except RayActorError as err:
            self._finish(_LOST, _lost_text(err, self.node_ip))
            return
        unavailable_since = None
        while True:
            try:
                out, code = ray.get(self.actor.read.remote(0.5))
            except ActorUnavailableError as err:  # transient (network); dead if it lasts
                unavailable_since = unavailable_since or time.monotonic()
                if time.monotonic() - unavailable_since > 30:
                    self._finish(_LOST, _lost_text(err, self.node_ip))
                    return
                time.sleep(0.5)
                continue
            except RayActorError as err:
                self._finish(_LOST, _lost_text(err, self.node_ip))
                return
            unavailable_since = None
            yield from out
            if code is not None:
                self._finish(code)
                return

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(60.0 if timeout is None else timeout):
            if timeout is not None:
                raise subprocess.TimeoutExpired("ray actor", timeout)
            self._finish(_LOST, f"its Ray actor on node {self.node_ip} stopped answering")  # never hang
        return self.returncode

    def signal_group(self, signum: int) -> None:
        if self.returncode is not None:
            return
        try:
            if signum == signal.SIGKILL:
                self._ray.kill(self.actor)  # the child dies with it (PR_SET_PDEATHSIG)
            else:
                self.actor.signal.remote(int(signum))
        except Exception:  # noqa: BLE001 - the actor is gone: nothing to signal
            pass


def _lost_text(err: BaseException, node_ip: str) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"its Ray actor on node {node_ip} was lost: the node or the process died [{first[:200]}]"


class RayProcesses(ProcessBackend):
    """Each process of the job in a small actor in its machine's bundle of the
    placement group (`RayLauncher` fills in the group and where each machine landed)."""

    def __init__(self, opts: RayOptions) -> None:
        self.opts = opts
        self.pg = None
        self.cluster: ClusterSpec | None = None
        self.bundle_of: dict[str, int] = {}
        self.node_ip_of: dict[str, str] = {}
        self.actors: list = []
        self._actor_cls = None

    def spawn(self, p: Proc, args: list[str], env: dict[str, str], cores) -> RemoteProcess:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._actor_cls is None:
            self._actor_cls = ray.remote(max_concurrency=4)(_RankProcess)
        opts = {"num_cpus": self.opts.cpus_per_process, "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=self.bundle_of[p.machine.name])}
        if uses_gpu(self.cluster, p.machine):
            if self.opts.gpu_resource == "GPU":
                opts["num_gpus"] = 1  # Ray then sets CUDA_VISIBLE_DEVICES for the process
            else:
                opts["resources"] = {self.opts.gpu_resource: 1.0}
        actor = self._actor_cls.options(**opts).remote()
        self.actors.append(actor)
        return RemoteProcess(ray, actor, actor.start.remote(args, env, os.getcwd()), self.node_ip_of[p.machine.name])

    def signal(self, child: Child, signum: int) -> None:
        child.popen.signal_group(signum)

    def exit_text(self, child: Child) -> str:
        return child.popen.lost or super().exit_text(child)

    def host_pid(self, child: Child) -> None:
        return None  # the process runs in an actor, maybe on another node


class RayLauncher(Launcher):
    """The single launcher, with processes placed by Ray instead of started here."""

    def __init__(self, cfg: LaunchConfig, opts: RayOptions):
        self.backend: RayProcesses
        super().__init__(cfg, RayProcesses(opts))
        self.opts = opts

    def run(self) -> int:
        cfg = self.cfg
        if cfg.node_rank is not None or cfg.master_addr:
            raise UserError("--ray starts every process of the job from this driver: drop --node-rank and "
                            "--master-addr (Ray places the machines; the driver hosts the rendezvous)")
        emulate = cfg.cluster.network.emulate
        if emulate not in ("none", "auto"):
            raise UserError(f"network emulation {emulate!r} runs a whole cluster on one host; on a Ray cluster the "
                            "real network is used: set `network: {emulate: none}` or drop --emulate")
        ray = connect(self.opts.address)
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        try:
            placed = self._reserve(ray, placement_group, placement_group_table)
            if placed is None:
                self._log("hetrain: stop requested before the job was placed; relaunch to run it")
                return EXIT_STOPPED
            self.backend.cluster = placed
            self.cfg = replace(cfg, cluster=placed, master_addr=ray.util.get_node_ip_address(), node_rank=None)
            return super().run()
        finally:
            for a in self.backend.actors:
                try:
                    ray.kill(a)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if self.backend.pg is not None:
                try:
                    remove_placement_group(self.backend.pg)  # the GPUs go back to the cluster
                except Exception:  # noqa: BLE001
                    pass

    def _reserve(self, ray, placement_group, placement_group_table) -> ClusterSpec | None:
        cfg = self.cfg
        resources = ray.cluster_resources()
        bundles, self.backend.bundle_of = machine_bundles(cfg.cluster, cfg.comm.mode, self.opts, resources)
        self.backend.pg = placement_group(bundles, strategy=self.opts.strategy, name=f"hetrain-{self.job_id}")
        ready_ref, deadline = self.backend.pg.ready(), time.monotonic() + self.opts.reserve_timeout_s
        ready = []
        while not ready and time.monotonic() < deadline and not STOP_REQUESTED.is_set():
            ready, _ = ray.wait([ready_ref], timeout=0.5)
        if STOP_REQUESTED.is_set():
            return None  # stopped while waiting for the cluster: nothing ran
        if not ready:
            raise UserError(f"the Ray cluster did not grant this job's resources within {self.opts.reserve_timeout_s:.0f}s: "
                            f"asked for {bundles} ({self.opts.strategy}); available now: "
                            f"{ {k: v for k, v in ray.available_resources().items() if not k.startswith('node:')} }")
        table = placement_group_table(self.backend.pg)
        ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        by_bundle = table["bundles_to_node_id"]
        machines = []
        for m in cfg.cluster.machines:
            if m.name in self.backend.bundle_of:
                addr = ip[by_bundle[self.backend.bundle_of[m.name]]]
                self.backend.node_ip_of[m.name] = addr
                m = m.model_copy(update={"address": addr, "node": 0})
            else:
                m = m.model_copy(update={"node": 0})
            machines.append(m)
        nodes = sorted({by_bundle[i] for i in self.backend.bundle_of.values()})
        self._log(f"hetrain: Ray placement group {self.backend.pg.id.hex()[:8]}: {len(bundles)} bundles on {len(nodes)} "
                  f"node(s) ({', '.join(sorted(set(self.backend.node_ip_of.values())))})")
        return cfg.cluster.model_copy(update={"machines": tuple(machines),
                                              "network": cfg.cluster.network.model_copy(update={"emulate": "none"})})


def launch_on_ray(cfg: LaunchConfig, opts: RayOptions) -> int:
    return RayLauncher(cfg, opts).run()
