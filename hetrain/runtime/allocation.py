"""Where to meet, read from the allocation a launcher runs in, as torchrun reads it.

`hetrain launch` without rendezvous flags inside a multi-node allocation takes the
number of nodes, this node's rank and the master's address from the environment the
scheduler set, so one command line serves every node:

- torchrun's own convention, `PET_<FLAG>` for any of its flags (`PET_NNODES`,
  `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`, `PET_NPROC_PER_NODE`,
  `PET_RDZV_ENDPOINT`, `PET_RDZV_ID`): what Kubeflow Trainer's TrainJob and the
  training operator's PyTorchJob set in every pod;
- a Slurm job step (`srun`): `SLURM_STEP_NUM_NODES` (else `SLURM_JOB_NUM_NODES` /
  `SLURM_NNODES`), `SLURM_NODEID`, the first host of `SLURM_STEP_NODELIST` (else
  `SLURM_JOB_NODELIST`) as master, `MASTER_PORT` or 15000 + the job id's last four
  digits (Lightning's rule, so two jobs sharing a node do not collide);
- a PyTorchJob pod without `PET_*` (older operators): `MASTER_ADDR`, `MASTER_PORT`,
  `WORLD_SIZE` (pods) and `RANK` (this pod), read only where `LOCAL_RANK` is unset, so
  the variables a launcher hands its own processes are never taken for an allocation.

A flag given on the command line always wins over the environment; `--standalone` and
a one-node allocation leave everything as it was.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Literal, Mapping

from ..errors import UserError

Source = Literal["torchrun env (PET_*)", "Slurm", "PyTorchJob"]
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07]`, `a[1-2]-b,c`, `r[1-2]n[1-2]`) as
    host names, in Slurm's order. Written here (a few lines) rather than calling
    `scontrol show hostnames`, which exists only where Slurm's client is installed, and
    a launcher inside a container often lacks it. Zero padding is kept (`01-03` gives
    01 02 03)."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_one(item, text))
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0 or depth > 1:
            raise UserError(f"host list {text!r}: brackets do not match (write e.g. node[01-03,07])")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise UserError(f"host list {text!r}: a '[' is never closed (write e.g. node[01-03,07])")
    items.append(text[start:])
    return [item for item in (s.strip() for s in items) if item]


def _expand_one(item: str, whole: str) -> list[str]:
    """One host pattern: every bracket group expanded, left to right (a cartesian product)."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    tails = _expand_one(rest, whole) if rest else [""]
    out = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise UserError(f"host list {whole!r}: {part!r} is not a number or a range like 01-03")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise UserError(f"host list {whole!r}: range {part!r} runs backwards")
        for n in range(int(lo), int(hi) + 1):
            out.extend(f"{prefix}{n:0{len(lo)}d}{tail}" for tail in tails)
    return out


@dataclass(frozen=True)
class Allocation:
    """What an allocation says about this launch (None: the environment does not say)."""

    source: Source
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    nproc_per_node: str | None = None
    rdzv_endpoint: str | None = None
    job_id: str | None = None

    def describe(self) -> str:
        where = self.rdzv_endpoint or f"{self.master_addr}:{self.master_port or 'default port'}"
        return f"{self.source}: node {self.node_rank} of {self.nnodes}, rendezvous at {where}"


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value in (None, ""):
        return None
    try:
        return int(str(value).split("(")[0])  # Slurm writes counts like "2(x3)" in a few variables
    except ValueError:
        raise UserError(f"environment variable {key}={value!r} is not a number; unset it or fix it") from None


def _from_pet(env: Mapping[str, str]) -> Allocation | None:
    nnodes = env.get("PET_NNODES")
    if not nnodes and not env.get("PET_NODE_RANK"):
        return None
    from .torchrun import parse_nnodes

    return Allocation("torchrun env (PET_*)", parse_nnodes(nnodes or "1"), _int(env, "PET_NODE_RANK") or 0,
                      env.get("PET_MASTER_ADDR") or None, _int(env, "PET_MASTER_PORT"),
                      env.get("PET_NPROC_PER_NODE") or None, env.get("PET_RDZV_ENDPOINT") or None,
                      env.get("PET_RDZV_ID") or None)


def _from_slurm(env: Mapping[str, str]) -> Allocation | None:
    if not env.get("SLURM_JOB_ID"):
        return None
    in_step = bool(env.get("SLURM_STEP_NUM_NODES"))
    nnodes = (_int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
              or 1)
    if nnodes < 2:
        return None
    if not in_step:
        raise UserError(f"this Slurm allocation has {nnodes} nodes, but `hetrain launch` runs only here (not in a "
                        "job step); start one launcher per node: `srun --ntasks-per-node=1 hetrain launch ...` "
                        "(examples/deploy/hetrain.sbatch), or give --nnodes 1 to run on this node alone")
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if tasks is not None and tasks != nnodes:
        raise UserError(f"this Slurm step runs {tasks} tasks on {nnodes} nodes; hetrain needs one launcher per node "
                        "(it starts the node's processes itself): `srun --ntasks-per-node=1 hetrain launch ...`")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = expand_hostlist(nodelist) if nodelist else []
    master = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    job = env["SLURM_JOB_ID"]
    port = _int(env, "MASTER_PORT") or 15000 + int(re.sub(r"\D", "", job)[-4:] or 0)
    node_rank = _int(env, "SLURM_NODEID")
    if node_rank is None:
        raise UserError("SLURM_NODEID is not set in this Slurm step; give --node-rank")
    return Allocation("Slurm", nnodes, node_rank, master, port, job_id=f"slurm-{job}")


def _from_pytorchjob(env: Mapping[str, str]) -> Allocation | None:
    if env.get("LOCAL_RANK") is not None or not all(env.get(k) for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK")):
        return None
    nnodes = _int(env, "WORLD_SIZE") or 1
    if nnodes < 2:
        return None
    return Allocation("PyTorchJob", nnodes, _int(env, "RANK") or 0, env["MASTER_ADDR"], _int(env, "MASTER_PORT"))


def detect(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this launcher runs in (torchrun's `PET_*` first, then Slurm, then a
    PyTorchJob's plain variables), or None outside one."""
    env = os.environ if env is None else env
    return _from_pet(env) or _from_slurm(env) or _from_pytorchjob(env)


def apply(flags, env: Mapping[str, str] | None = None, *, cluster_file: bool = False):
    """torchrun flags (`runtime.torchrun.TorchrunFlags`) with what the command line left
    out taken from the allocation; returns (flags, the allocation used or None). With a
    cluster file (`cluster_file`), the file decides the processes per node."""
    if flags.standalone or (flags.rdzv_endpoint and flags.node_rank is not None and flags.nnodes is not None):
        return flags, None
    alloc = detect(env)
    if alloc is None or (alloc.nnodes < 2 and alloc.source != "torchrun env (PET_*)"):
        return flags, None
    from .torchrun import parse_nproc

    nproc = (parse_nproc(alloc.nproc_per_node)
             if flags.nproc_per_node is None and alloc.nproc_per_node and not cluster_file else None)
    explicit_endpoint = flags.rdzv_endpoint or flags.master_addr
    updated = replace(
        flags,
        nnodes=flags.nnodes if flags.nnodes is not None else alloc.nnodes,
        node_rank=flags.node_rank if flags.node_rank is not None else alloc.node_rank,
        nproc_per_node=flags.nproc_per_node if flags.nproc_per_node is not None else (nproc.count if nproc else None),
        cuda=flags.cuda or bool(nproc and nproc.cuda),
        master_addr=flags.master_addr or (None if explicit_endpoint or alloc.rdzv_endpoint else alloc.master_addr),
        master_port=flags.master_port if flags.master_port is not None else (
            None if flags.rdzv_endpoint or alloc.rdzv_endpoint else alloc.master_port),
        rdzv_endpoint=flags.rdzv_endpoint or (None if flags.master_addr else alloc.rdzv_endpoint))
    return updated, alloc
