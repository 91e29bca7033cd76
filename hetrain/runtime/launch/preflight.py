"""Checks before anything starts (no namespace, store or process): the entry point
exists, the workers' cores fit this host, and this node has the GPUs (and NCCL) its
machines ask for. A typo or a missing GPU fails here, in the user's terms, instead of
after every process started and the servers gave up waiting."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ...cluster.spec import ClusterSpec
from ...errors import UserError
from ..cores import assign_cores
from ..env import CommConfig
from ..topology import Proc, Topology, build_topology


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


def local_procs(topo: Topology, node_rank: int | None) -> list[Proc]:
    """The processes of `topo` a launcher of `node_rank` starts (None: all), in rank order."""
    return [p for p in topo.procs if node_rank is None or p.machine.node == node_rank]


def plan_cores(local: list[Proc]):
    """Cores of this host for the workers that declare `threads:` (raises when they do not fit)."""
    return assign_cores(local, sorted(os.sched_getaffinity(0)))


def check_node(cluster: ClusterSpec, comm: CommConfig, node_rank: int | None, gpus_here: bool = True) -> str | None:
    """This node's share of the job fits this host: its workers' cores and its GPUs
    (`gpus_here` False: the processes run elsewhere, e.g. on Ray's nodes, and only the
    flags are checked). Returns a note for the log when CUDA workers share a GPU (and
    so use gloo)."""
    from ..devices import one_host, plan_backends, preflight as gpu_preflight, sharing_note  # imports torch

    topo = build_topology(cluster, comm.mode)
    plan_cores(local_procs(topo, node_rank))
    if gpus_here:
        gpu_preflight(cluster, topo, comm, node_rank)
    else:
        plan_backends(topo, comm)  # raises where the flags ask for NCCL that cannot work
    if not gpus_here:
        return None
    return sharing_note(build_topology(one_host(cluster) if node_rank is None else cluster, comm.mode), comm)
