"""torchrun's conventions: its launch flags, and joining a job that plain torchrun started.

`hetrain launch` accepts torchrun's flags so an existing launch line works with
`torchrun` replaced by `hetrain launch`. Without a cluster file they describe the
cluster: `--nnodes N --nproc-per-node P` is N nodes of P worker processes each, every
process a worker machine of its own with the default device, in all-reduce mode unless
`--mode` says otherwise. With a cluster file the file describes the cluster, and flags
that contradict it are refused.

The other direction: a script that calls `hetrain.init()` under plain torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, no HETRAIN_* variables) joins as a
workers-only all-reduce job over torchrun's rendezvous (`from_torchrun_environ`).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Literal

from ..cluster.spec import ClusterSpec, default_cluster, parse_cluster
from ..errors import UserError
from ..modes import Mode

TORCHRUN_MASTER_PORT = 29500  # torchrun's default --master-port
TORCHRUN_RDZV_PORT = 29400  # torchrun's default port of a --rdzv-endpoint given without one
RdzvBackend = Literal["c10d", "static"]


@dataclass(frozen=True)
class Nproc:
    """`--nproc-per-node` resolved: how many worker processes, and whether each is bound
    to a CUDA device of its own (`gpu`, or `auto` where CUDA is)."""

    count: int
    cuda: bool = False


def parse_nproc(value: str) -> Nproc:
    """`--nproc-per-node`: a count, or torchrun's `gpu` (one per CUDA device), `cpu`
    (one per core) and `auto` (gpu where CUDA is, else cpu)."""
    v = str(value).strip().lower()
    if v in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            return Nproc(gpus, cuda=True)
        if v == "gpu":
            raise UserError("--nproc-per-node gpu: this host has no CUDA device; give a number of processes")
        v = "cpu"
    if v == "cpu":
        return Nproc(len(os.sched_getaffinity(0)))
    try:
        n = int(v)
    except ValueError:
        raise UserError(f"--nproc-per-node {value!r} is not a number of processes (or gpu, cpu, auto)") from None
    if n < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {n}")
    return Nproc(n)


def parse_nnodes(value: str) -> int:
    """`--nnodes N` (or torchrun's elastic `MIN:MAX` with MIN == MAX)."""
    parts = str(value).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 1:
        raise UserError(f"--nnodes {value!r} is not a number of nodes (write e.g. --nnodes 2)")
    if lo != hi:
        raise UserError(f"--nnodes {value}: hetrain runs a fixed number of nodes; give one number (e.g. --nnodes {hi})")
    return lo


def parse_endpoint(value: str, default_port: int = TORCHRUN_RDZV_PORT) -> tuple[str, int]:
    """`HOST`, `HOST:PORT` or `[V6]:PORT` -> (IP address, port)."""
    v = value.strip()
    host, port = v, default_port
    if v.startswith("["):
        host, _, rest = v[1:].partition("]")
        if rest:
            port = rest.removeprefix(":")
    elif v.count(":") == 1:
        host, port = v.split(":")
    try:
        port = int(port)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise UserError(f"--rdzv-endpoint {value!r}: the port must be a number 1..65535 (write HOST:PORT)") from None
    return resolve_host(host, "--rdzv-endpoint"), port


def resolve_host(host: str, flag: str) -> str:
    """A host name or address -> an IP address (the cluster speaks in addresses)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    for family in (socket.AF_INET, socket.AF_UNSPEC):  # IPv4 first: `localhost` is 127.0.0.1, not ::1
        try:
            return socket.getaddrinfo(host, None, family=family, type=socket.SOCK_STREAM)[0][4][0]
        except (socket.gaierror, UnicodeError):
            continue
    raise UserError(f"{flag} {host!r}: cannot resolve this host name; give an IP address")


def local_address_towards(addr: str) -> str:
    """This host's address on the route to `addr` (itself when `addr` is local): the
    address this node's processes bind to. No packet is sent (a UDP socket is only
    connected, which picks the route)."""
    if ipaddress.ip_address(addr).is_loopback:
        return addr
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
        except OSError as err:
            raise UserError(f"no route from this host to {addr}: {err}; check --master-addr / --rdzv-endpoint") from None
        return s.getsockname()[0]


def workers_cluster(nnodes: int, nproc_per_node: int, address: str = "127.0.0.1", cuda: bool = False) -> ClusterSpec:
    """The cluster a torchrun line describes: `nnodes` nodes of `nproc_per_node` worker
    machines, one process each, named `w<rank>` in torchrun's rank order (node-major).
    With `cuda` (`--nproc-per-node gpu|auto` on a host with CUDA) worker i of a node is
    bound to cuda:i of its host (`device.index`), as torchrun's LOCAL_RANK would pick it.

    Only this node's address is known to it, so every machine carries `address`; a
    process uses only its own machine's address (to bind gloo), so the other nodes'
    entries are never read."""
    def device(i: int) -> dict:
        return {"kind": "gpu", "cuda": True, "index": i} if cuda else {"kind": "cpu"}

    machines = [{"name": f"w{node * nproc_per_node + i}", "role": "worker", "device": device(i),
                 "address": address, "node": node}
                for node in range(nnodes) for i in range(nproc_per_node)]
    return parse_cluster({"name": f"torchrun-{nnodes}x{nproc_per_node}", "machines": machines}, "<torchrun flags>")


@dataclass(frozen=True)
class TorchrunFlags:
    """torchrun's launch flags as `hetrain launch` received them (None: not given)."""

    nnodes: int | None = None
    nproc_per_node: int | None = None
    cuda: bool = False  # --nproc-per-node gpu|auto found CUDA devices: one per process
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: RdzvBackend = "c10d"
    standalone: bool = False

    @property
    def describe_cluster(self) -> bool:
        """Flags that say how many processes to start (rather than where to meet)."""
        return self.standalone or self.nnodes is not None or self.nproc_per_node is not None


@dataclass(frozen=True)
class Resolved:
    """What the launcher needs: the cluster, the mode, and where this node meets the others."""

    cluster: ClusterSpec
    mode: str
    node_rank: int | None  # None: every node's processes run here (a one-host cluster)
    assign_node_rank: bool  # multi-node without --node-rank: node ranks are handed out at rendezvous
    master_addr: str | None
    master_port: int  # 0: a free port (single node)


def resolve(flags: TorchrunFlags, cluster: ClusterSpec | None, mode: str | None) -> Resolved:
    """Map torchrun's flags onto a cluster (pure; the launcher runs the result).

    - no cluster file, `--nnodes/--nproc-per-node/--standalone`: `workers_cluster`,
      mode allreduce unless `--mode` is given;
    - a cluster file: it decides; `--nnodes`/`--nproc-per-node` must agree with it;
    - neither: hetrain's built-in cluster (4 mixed workers, 2 CPU machines), mode byteps.
    """
    master_addr = resolve_host(flags.master_addr, "--master-addr") if flags.master_addr else None
    master_port = flags.master_port
    if flags.rdzv_endpoint:
        r_addr, r_port = parse_endpoint(flags.rdzv_endpoint)
        if master_addr and master_addr != r_addr:
            raise UserError(f"--rdzv-endpoint {flags.rdzv_endpoint} and --master-addr {flags.master_addr} name "
                            "different hosts; give one of them")
        if master_port and master_port != r_port:
            raise UserError(f"--rdzv-endpoint {flags.rdzv_endpoint} and --master-port {master_port} name different "
                            "ports; give one of them")
        master_addr, master_port = r_addr, r_port
    if flags.standalone:
        if flags.nnodes not in (None, 1):
            raise UserError(f"--standalone runs one node; drop it or --nnodes {flags.nnodes}")
        if master_addr or master_port:
            raise UserError("--standalone picks its own local rendezvous; drop --rdzv-endpoint/--master-addr/"
                            "--master-port, or drop --standalone")
    if master_port is not None and not 0 <= master_port < 65536:
        raise UserError(f"--master-port {master_port} is not a port (0..65535)")
    if flags.node_rank is not None and flags.node_rank < 0:
        raise UserError(f"--node-rank must be >= 0, got {flags.node_rank}")

    synthesized = cluster is None and flags.describe_cluster
    if cluster is not None:
        _check_agrees(flags, cluster)
    elif synthesized:
        address = local_address_towards(master_addr) if master_addr else "127.0.0.1"
        cluster = workers_cluster(flags.nnodes or 1, flags.nproc_per_node or 1, address, cuda=flags.cuda)
        mode = mode or Mode.ALLREDUCE
    else:
        cluster = default_cluster()
    mode = mode or Mode.BYTEPS
    nnodes = cluster.nnodes
    if flags.node_rank is not None and flags.node_rank >= nnodes:
        raise UserError(f"--node-rank {flags.node_rank} is outside 0..{nnodes - 1} (the job has {nnodes} node(s))")
    assign = False
    # a cluster file of several nodes without --node-rank runs all of them here (one host)
    if nnodes > 1 and (flags.node_rank is not None or synthesized):
        if not master_addr:
            raise UserError(f"a {nnodes}-node launch needs the rendezvous host: --master-addr ADDR (or --rdzv-endpoint "
                            "HOST:PORT), the same on every node")
        master_port = master_port or TORCHRUN_MASTER_PORT
        # identical nodes without --node-rank: ranks are handed out in order of arrival, as torchrun's c10d does
        assign = flags.node_rank is None
    return Resolved(cluster, mode, flags.node_rank, assign, master_addr, master_port or 0)


def _check_agrees(flags: TorchrunFlags, cluster: ClusterSpec) -> None:
    """A cluster file decides the processes; torchrun flags may only restate it."""
    if flags.nnodes is not None and flags.nnodes != cluster.nnodes:
        raise UserError(f"--nnodes {flags.nnodes} contradicts the cluster file, which puts its machines on "
                        f"{cluster.nnodes} node(s) (`node:`); drop --nnodes or change the file")
    if flags.standalone and cluster.nnodes > 1:
        raise UserError(f"--standalone runs one node, but the cluster file puts its machines on {cluster.nnodes} "
                        "nodes; drop --standalone and give --node-rank and --master-addr")
    if flags.nproc_per_node is not None:
        per_node = {n: sum(1 for m in cluster.workers if m.node == n) for n in range(cluster.nnodes)}
        wrong = {n: k for n, k in per_node.items() if k != flags.nproc_per_node}
        if wrong:
            got = ", ".join(f"node {n}: {k}" for n, k in per_node.items())
            raise UserError(f"--nproc-per-node {flags.nproc_per_node} contradicts the cluster file, which has "
                            f"{got} worker process(es); drop --nproc-per-node (the file decides) or change the file")


def agent_environ(*, group_rank: int, group_world_size: int, role: str, role_rank: int, role_world_size: int,
                  restart: int, max_restarts: int, run_id: str, master_port: int, error_file: str) -> dict[str, str]:
    """The variables torchrun's agent sets for a process beyond RANK/WORLD_SIZE/LOCAL_*
    /MASTER_ADDR (`torch.distributed.elastic.agent.server.local_elastic_agent`), so a
    script written for torchrun finds them under `hetrain launch` too:

    - GROUP_RANK / GROUP_WORLD_SIZE: this node (its launcher) and the number of nodes;
    - ROLE_NAME / ROLE_RANK / ROLE_WORLD_SIZE: torchrun's one role is `default`; hetrain's
      workers are that role (ROLE_RANK = worker rank), its summation servers `server`;
    - MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True: `init_process_group()` (env://)
      joins the launcher-served store as a client instead of hosting one on rank 0;
    - TORCHELASTIC_RESTART_COUNT (the round: one more per restart or resize),
      TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID (the job id), and
      TORCHELASTIC_ERROR_FILE, where `torch.distributed.elastic`'s `@record` writes a
      failing rank's traceback.

    TORCH_NCCL_ASYNC_ERROR_HANDLING is left to the process (hetrain's NCCL set-up
    chooses it; torchrun defaults it to 1)."""
    return {
        "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_NAME": role, "ROLE_RANK": str(role_rank), "ROLE_WORLD_SIZE": str(role_world_size),
        "MASTER_PORT": str(master_port), "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_ERROR_FILE": error_file,
    }


def from_torchrun_environ(environ: dict[str, str] | None = None):
    """The ProcEnv of a process that plain torchrun (or any env:// launcher) started, or
    None when RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are not all set.

    torchrun knows no summation servers and no hetrain secret: the job is workers-only,
    all-reduce mode, over torchrun's own store."""
    from .env import CommConfig, ProcEnv

    e = os.environ if environ is None else environ
    need = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(e.get(k) for k in need):
        return None
    try:
        rank, world = int(e["RANK"]), int(e["WORLD_SIZE"])
        local_rank = int(e.get("LOCAL_RANK", "0"))
        local_world = int(e.get("LOCAL_WORLD_SIZE", str(world)))
        port = int(e["MASTER_PORT"])
    except ValueError as err:
        raise UserError(f"torchrun environment: {err}; RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and "
                        "MASTER_PORT must be integers") from None
    if not (0 <= rank < world and 0 < local_world and world % local_world == 0):
        raise UserError(f"torchrun environment: RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world} "
                        "do not describe a job (0 <= RANK < WORLD_SIZE, equal processes per node)")
    address = local_address_towards(resolve_host(e["MASTER_ADDR"], "MASTER_ADDR"))
    cluster = workers_cluster(world // local_world, local_world, address)
    run_id = e.get("TORCHELASTIC_RUN_ID", "none")
    return ProcEnv(rank, world, e["MASTER_ADDR"], port, job_id=run_id, cluster_json=cluster.model_dump_json(),
                   comm=CommConfig(mode=Mode.ALLREDUCE), run_dir=e.get("HETRAIN_RUN_DIR", f"runs/torchrun-{run_id}"),
                   local_rank=local_rank, local_world_size=local_world, origin="torchrun")
