"""The job's rendezvous store: node 0 hosts a torch.distributed TCPStore on a socket of
its own (bound to the cluster address only); the other nodes' launchers connect to it.
Nodes of identical shape without `--node-rank` take their rank here, in order of
arrival, as torchrun's c10d rendezvous hands them out."""
from __future__ import annotations

import ipaddress
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

from ...errors import UserError
from ..netif import iface_for_address
from .config import LaunchConfig


def listen(addr: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {addr}:{port} for the job's rendezvous store: {err}; "
                        "pick another --master-port or check --master-addr is this node's cluster address") from None
    sock.listen(512)
    return sock


def listen_fd_backend() -> dict:
    """TCPStore arguments for serving on a socket of ours (`master_listen_fd`): the libuv
    backend, PyTorch's default from 2.4, takes such a socket only from 2.8 on; before
    that the classic backend (`use_libuv=False`, a parameter since 2.2) does."""
    import torch

    version = torch.torch_version.TorchVersion(torch.__version__)
    return {"use_libuv": False} if "2.2" <= version < "2.8" else {}


def is_local_address(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback or iface_for_address(addr) is not None
    except ValueError:
        return False


@dataclass
class OpenStore:
    store: object  # torch.distributed.TCPStore
    port: int
    node_rank: int | None
    sock: socket.socket | None  # the hosting node's listening socket: the store serves on its fd


def open_store(cfg: LaunchConfig, master_addr: str, timeout: timedelta) -> OpenStore:
    """Host the rendezvous store (node 0) or connect to it; hand out this node's rank
    when the nodes are identical and none was given."""
    import torch.distributed as dist  # deferred: `hetrain --help` stays fast

    node_rank = cfg.node_rank
    hosting = node_rank in (None, 0) and not cfg.assign_node_rank
    sock = None
    if cfg.assign_node_rank and is_local_address(master_addr):
        try:  # the rendezvous host is this machine: host it, unless another launcher here already does
            sock = listen(master_addr, cfg.master_port)
            hosting = True
        except UserError:
            sock = None
    if hosting:
        sock = sock or listen(master_addr, cfg.master_port)
        port = sock.getsockname()[1]
        store = dist.TCPStore(master_addr, port, None, True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno(), **listen_fd_backend())
        store.set("hetrain/nonce", uuid.uuid4().hex)
    else:
        port = cfg.master_port
        store = dist.TCPStore(master_addr, port, None, False, timeout=timeout)
    if cfg.assign_node_rank:
        node_rank = 0 if hosting else int(store.add("hetrain/nodes", 1))
        if node_rank >= cfg.cluster.nnodes:
            raise UserError(f"node {node_rank + 1} joined a job of --nnodes {cfg.cluster.nnodes}; every node must "
                            "give the same --nnodes, and each job its own --rdzv-endpoint / --master-port")
    return OpenStore(store, port, node_rank, sock)
