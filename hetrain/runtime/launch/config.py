"""What a launch is asked to do (`LaunchConfig`), and the exit codes of a job's processes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from ...cluster.spec import ClusterSpec
from ...errors import UserError
from ..env import CommConfig
from ..supervisor import ElasticConfig
from .heap import HeapPolicy

EXIT_STOPPED = 3  # a process stopped at a checkpoint because it was asked to (SIGUSR1)
EXIT_RESIZE = 4  # workers stopped at a commit so that the launcher can change the job's machines


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
    heap: HeapPolicy = "keep"  # the processes' C heap keeps its pages between steps (launch/heap.py)

    def __post_init__(self) -> None:
        if self.heap not in get_args(HeapPolicy):
            raise UserError(f"heap={self.heap!r}: use one of {', '.join(get_args(HeapPolicy))}")
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
