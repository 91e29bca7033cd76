"""Per-process job context: who am I, the process groups, and how to report a lost peer."""
from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..cluster.spec import ClusterSpec
from ..errors import UserError
from ..modes import Mode
from .auth import admit, load_secret
from .commthreads import configure
from .devices import Backends, bind, nccl_environment, nccl_group_options, plan_backends
from .env import CommConfig, ProcEnv
from .heartbeat import Heartbeat, mark_leaving, stale_ranks
from .settle import settle_at_exit
from .rounds import dead_key
from .netif import iface_for_address
from .topology import Topology, build_topology, lanes_for


class PeerLostError(RuntimeError):
    """A peer process died or stopped answering; the message names it."""


@dataclass
class Context:
    env: ProcEnv | None
    cluster: ClusterSpec | None
    topology: Topology | None
    store: object | None
    worker_group: object | None
    failed: bool = False  # a peer was lost: no more collectives, not even at shutdown
    lanes: list = None  # extra process groups = extra parallel connections to servers
    bucket: object = None  # emulated uplink (cluster/ratelimit.py), when asked for
    machine_name: str = ""
    device: torch.device = torch.device("cpu")  # where this worker's tensors live (cuda:<local rank> or cpu)
    backends: Backends = Backends()
    nccl_group: object = None  # the workers over NCCL (every worker a GPU of its own), else None
    # machines with several workers: (reduce group, broadcast group) of this worker's machine;
    # two groups so that reduces issued during backward never queue behind a broadcast
    # that waits for its sum from the servers
    local_groups: tuple | None = None
    # the same pair over gloo, for host tensors (the pair above is NCCL-only where the machine's
    # workers are GPUs of their own); the same groups as `local_groups` where those are gloo
    local_host_groups: tuple | None = None
    local_ranks: tuple[int, ...] = ()
    # gloo over every rank, for host collectives (step header, manifests, lane 0, the last
    # barrier) where the default group cannot carry CPU tensors (a torchrun script that called
    # init_process_group("nccl") itself); None: the default group is gloo
    host_group: object = None
    heartbeat: Heartbeat | None = None

    def pace(self, peer: int, nbytes: int) -> None:
        """Charge a send to another machine against this machine's emulated uplink."""
        if self.bucket is not None and self.topology.proc(peer).machine.name != self.machine_name:
            self.bucket.consume(nbytes)

    def lane(self, index: int):
        """The process group carrying lane `index` (0 = the host group: the default one)."""
        return self.host_group if index == 0 or not self.lanes else self.lanes[index - 1]

    @property
    def rank(self) -> int:
        return self.env.rank if self.env else 0

    @property
    def world_size(self) -> int:
        return self.env.world_size if self.env else 1

    @property
    def comm(self) -> CommConfig:
        return self.env.comm if self.env else CommConfig(mode=Mode.ALLREDUCE)

    @property
    def num_workers(self) -> int:
        return len(self.topology.workers) if self.topology else 1

    @property
    def is_worker(self) -> bool:
        return self.topology is None or self.topology.proc(self.rank).role == "worker"

    @property
    def distributed(self) -> bool:
        return self.env is not None

    def describe(self, rank: int) -> str:
        return self.topology.describe(rank) if self.topology else f"rank {rank}"

    def lost_peers(self, wait_s: float = 3.0) -> dict[int, str]:
        """Ranks the launcher has reported lost (it writes hetrain/dead/<rank> =
        "died: how" or "hung: why"), with that record.

        A survivor often sees the broken connection before the launcher has reaped
        the dead process, so give the launcher a moment to record it.
        """
        if self.store is None:
            return {}
        keys = {r: dead_key(r) for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + wait_s
        try:
            self.store.set_timeout(timedelta(seconds=2))
            while True:
                dead = {r: self.store.get(k).decode(errors="replace") for r, k in keys.items() if self.store.check([k])}
                if dead or time.monotonic() > deadline:
                    return dead
                time.sleep(0.1)
        except Exception:  # the store itself is gone: the launcher's node died
            return {}

    def silent_peers(self, wait_s: float = 4.0) -> list[int]:
        """After a collective timed out with no rank reported dead: every survivor posts
        that it is stuck too; the ranks that never post are the ones that hang."""
        if self.store is None:
            return []
        try:
            self.store.set(f"hetrain/stuck/{self.rank}", "1")
            others = [r for r in range(self.world_size) if r != self.rank]
            deadline = time.monotonic() + wait_s
            while True:
                silent = [r for r in others if not self.store.check([f"hetrain/stuck/{r}"])]
                if not silent or time.monotonic() > deadline:
                    return silent if len(silent) < len(others) else []
                time.sleep(0.2)
        except Exception:
            return []

    def peer_error(self, what: str, suspects: list[int], err: BaseException) -> PeerLostError:
        """Turn a gloo failure into a message that names the lost rank(s).

        Evidence, strongest first: the launcher's record of a rank that died or hung;
        a rank whose heartbeat stands still while the others beat (it hangs; the rest
        wait); the peer this rank was waiting on; ranks that never said they are stuck.
        """
        self.failed = True
        dead = self.lost_peers()
        if dead:
            names = sorted(dead)
            detail = "; ".join(_explain(dead[r]) for r in names)
        else:
            others = [r for r in range(self.world_size) if r != self.rank]
            stale = stale_ranks(self.store, others) if self.store is not None else []
            if stale:
                names, detail = stale, "the peer stopped answering: its heartbeat stood still while the others beat (hung)"
            else:
                names = suspects or self.silent_peers()
                detail = "the peer stopped answering or died"
        who = ", ".join(self.describe(r) for r in names) or "an unknown peer"
        first = str(err).splitlines()[0] if str(err) else ""
        return PeerLostError(
            f"{self.describe(self.rank)}: lost {who} while {what}: {detail}. "
            f"This round of the job cannot continue; the launcher restarts it from the last commit when "
            f"--max-restarts allows. [{type(err).__name__}: {first}]"
        )


def _explain(record: str) -> str:
    kind, _, why = record.partition(": ")
    if kind == "hung":
        return f"the peer stopped answering ({why})"
    return f"the peer died ({why or record})"


_CTX: Context | None = None
# what this process was in the job of several processes it left with shutdown(): joining
# again then takes an explicit hetrain.init() (`init(again=True)`)
_LEFT: str | None = None


def init(again: bool = False) -> Context:
    """Join the job described by the launcher's environment (idempotent).

    Without a launcher environment this is a one-process job: push_pull only applies
    the batch weighting, so the same script runs with `python script.py`. Started by
    plain torchrun (its variables, no HETRAIN_* ones), it joins torchrun's job as a
    workers-only all-reduce job (`runtime/torchrun.py`).

    Every call that needs the job joins it the first time. After shutdown() left a job
    of several processes, only `again` (hetrain.init()) joins anew; any other call is
    refused with what to do: the other processes have left or will not join with it,
    so a rendezvous of its own would hang until the timeout or fail on a refused
    connection.
    """
    global _CTX, _LEFT
    if _CTX is not None:
        return _CTX
    if _LEFT is not None and not again:
        raise UserError(f"{_LEFT} left the job with hetrain.shutdown(); hetrain's calls need the job: call them "
                        "before shutdown(), or call hetrain.init() on every process to join a new one")
    _LEFT = None
    env = ProcEnv.from_environ()
    if env is None:
        from .torchrun import from_torchrun_environ

        env = from_torchrun_environ()
    if env is None:
        _CTX = Context(None, None, None, None, None)
        return _CTX
    cluster = ClusterSpec.model_validate_json(env.cluster_json)
    topo = build_topology(cluster, env.comm.mode)
    if topo.world_size != env.world_size:
        raise UserError(f"launcher says world size {env.world_size} but cluster+mode give {topo.world_size}; "
                        "all nodes must use the same cluster file and --mode")
    me = topo.proc(env.rank)
    if me.role == "worker" and me.machine.threads:  # its own cores (runtime/cores.py): one thread each
        import torch

        torch.set_num_threads(me.machine.threads)
    device = bind(me, topo.describe(env.rank))  # before anything touches CUDA
    backends = plan_backends(topo, env.comm)
    iface = iface_for_address(me.machine.address)
    if backends.uses_nccl:
        nccl_environment(iface)
    # gloo operations get the longer backstop bound: dead and hung peers are found by
    # liveness within --timeout (CommConfig.op_timeout_s says why)
    timeout = env.comm.op_timeout_s
    heartbeat = None
    settle_at_exit()  # registered first, so it runs last: runtime/settle.py says why
    if env.origin == "torchrun":  # torchrun's store and agent: no hetrain liveness, no rounds
        store = _join_torchrun(env, iface, env.comm.timeout_s)
    else:
        if iface is None:
            raise UserError(f"machine {me.machine.name} has address {me.machine.address}, which no local interface "
                            "carries; fix `address` in the cluster file or run this node on that machine")
        os.environ["GLOO_SOCKET_IFNAME"] = iface  # gloo listens on the cluster address only
        rendezvous = env.comm.rendezvous_timeout_s
        client = dist.TCPStore(env.master_addr, env.master_port, None, False, timeout=timedelta(seconds=rendezvous))
        store = dist.PrefixStore(env.store_prefix, client)  # this round's keys only
        # beat from here on: a process that hangs even in the rendezvous below is named
        heartbeat = Heartbeat(env.master_addr, env.master_port, env.store_prefix, env.rank).start()
        # finalising is silent: tell the launcher it is expected, and end the heartbeat's thread first
        atexit.register(mark_leaving, store, env.rank, heartbeat)
        admit(store, load_secret(), env.rank, env.world_size, rendezvous)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=env.rank,
                                    world_size=env.world_size, timeout=timedelta(seconds=timeout))
        elif dist.get_world_size() != env.world_size:  # the script's own init_process_group(), torchrun-style
            raise UserError(f"the process group the script made has {dist.get_world_size()} ranks but the job has "
                            f"{env.world_size} processes (summation servers included); call hetrain.init() "
                            "before init_process_group(), or leave the group to hetrain")
    wait = timedelta(seconds=timeout)
    # every rank creates every group, in the same order (torch.distributed requires it); host
    # groups name gloo, never the default backend (a script's own NCCL default group)
    host_group = None if _default_carries_host_tensors() else dist.new_group(timeout=wait, backend="gloo")
    worker_group = dist.new_group(topo.worker_ranks, timeout=wait, backend="gloo")
    nccl_group = None
    if backends.worker == "nccl":
        nccl_group = dist.new_group(topo.worker_ranks, timeout=wait, backend="nccl", **nccl_group_options(device))
    local_groups, local_host_groups, local_ranks = None, None, ()
    for ranks in topo.worker_machines:
        if len(ranks) < 2:
            continue
        backend = backends.local[topo.proc(ranks[0]).machine.name]
        opts = nccl_group_options(device) if backend == "nccl" else {}
        pair = tuple(dist.new_group(ranks, timeout=wait, backend=backend, **opts) for _ in range(2))
        host = pair if backend == "gloo" else tuple(dist.new_group(ranks, timeout=wait, backend="gloo")
                                                    for _ in range(2))
        if env.rank in ranks:
            local_groups, local_host_groups, local_ranks = pair, host, tuple(ranks)
    lanes = []
    if topo.servers:
        extra = max(lanes_for([p.share for p in topo.servers], env.comm.max_lanes)) - 1
        lanes = [dist.new_group(list(range(env.world_size)), timeout=wait, backend="gloo") for _ in range(extra)]
    # every gloo group exists now: its socket thread yields the core to compute (commthreads.py)
    pinned = (bool(me.machine.threads) and hasattr(os, "sched_getaffinity")  # runtime/cores.py pinned it
              and len(os.sched_getaffinity(0)) == me.machine.threads)
    configure(env.comm.gloo_thread, on_host=device.type == "cpu", own_cores=me.role == "worker" and pinned,
              all_reduce=not env.comm.has_servers)
    if env.origin == "hetrain":
        store.set(f"hetrain/joined/{env.rank}", "1")  # the launcher: this rank is past the rendezvous
    from ..cluster.ratelimit import bucket_for

    _CTX = Context(env, cluster, topo, store, worker_group, lanes=lanes,
                   bucket=bucket_for(me.machine.name, me.machine.bandwidth), machine_name=me.machine.name,
                   device=device, backends=backends, nccl_group=nccl_group, local_groups=local_groups,
                   local_host_groups=local_host_groups, host_group=host_group,
                   local_ranks=local_ranks, heartbeat=heartbeat)
    _no_goodbye_after_a_crash(_CTX)
    return _CTX


def _default_carries_host_tensors() -> bool:
    """Whether the default process group runs collectives on CPU tensors (gloo), as the one
    hetrain makes does; a torchrun script's own `init_process_group("nccl")` does not."""
    backend = str(dist.get_backend()).lower()
    return backend == "gloo" or "cpu:gloo" in backend


def _no_goodbye_after_a_crash(ctx: Context) -> None:
    """An uncaught exception marks the context failed before the exit handlers run, so
    this process leaves without the orderly goodbye (the engine's stop announcement and
    the last barrier): its peers are mid-step, waiting for it, and would either wait for
    that barrier until the operation timeout or read the announcement as a worker that
    ran fewer steps. It simply exits; the launcher names it and its peers' calls fail
    at once, naming it too."""
    previous = sys.excepthook

    def hook(etype, value, tb):
        ctx.failed = True
        previous(etype, value, tb)

    sys.excepthook = hook


def _join_torchrun(env: ProcEnv, iface: str | None, timeout: float):
    """Join the process group of a job plain torchrun started: its env:// rendezvous
    (the agent's store), no shared-secret admission (torchrun has no secret). gloo binds
    to the interface that reaches MASTER_ADDR unless GLOO_SOCKET_IFNAME says otherwise.
    A script that already called `init_process_group` keeps its group."""
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout))
    elif dist.get_world_size() != env.world_size:
        raise UserError(f"the process group the script made has {dist.get_world_size()} ranks but torchrun's "
                        f"WORLD_SIZE is {env.world_size}; let hetrain.init() make it")
    from torch.distributed.distributed_c10d import _get_default_store

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hetrain/{restart}", _get_default_store())


def context() -> Context:
    return init()


def teardown(ctx: "Context | None") -> None:
    """Leave the job in order: one last global barrier, so no process closes its
    sockets while a peer is still using them (gloo's I/O thread aborts the whole process
    when a connection drops mid-teardown), then destroy the process groups."""
    if ctx is None or not ctx.distributed or not dist.is_initialized() or ctx.failed:
        return
    try:
        dist.barrier(group=ctx.host_group)
    except RuntimeError as err:
        raise ctx.peer_error("leaving the job", [], err) from None
    dist.destroy_process_group()


def shutdown() -> None:
    global _CTX, _LEFT
    ctx, _CTX = _CTX, None
    if ctx is not None and ctx.distributed:
        _LEFT = ctx.describe(ctx.rank)
    # the heartbeat goes on until the process exits: a process still running must never
    # look hung to the launcher, which sees the exit itself
    teardown(ctx)
