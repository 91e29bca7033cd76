"""Where a real job's processes run, and how one is started.

`Backend` says whether the ranks run on this host (an emulated GPU pool) or on a Ray
cluster; `launch_job` starts a job of a given world size through hetrain's single
launcher (`hetrain launch --mode allreduce -m hetrain.sched.worker`). Kept apart from the
executor's scheduling loop: `fit_sweep` and the tests start jobs the same way.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..cluster.hardware import Inventory
from ..errors import UserError
from .cluster import gpu_pools


@dataclass(frozen=True)
class Backend:
    """Where a job's processes run: `local` (this host, an emulated pool) or `ray`."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None            # ray: the cluster's GCS address, or auto
    gpu_resource: str = "GPU"             # ray: resource that counts GPUs (custom for emulated ones)
    cpus_per_process: float = 0.5         # ray: CPUs reserved for each rank

    def __post_init__(self) -> None:
        if self.kind == "ray" and not self.address:
            raise UserError("the ray backend needs the cluster's address: --address HOST:PORT (or auto)")

    def machine_kind(self, gpu_type: str) -> str:
        # on Ray the device kind picks the node's GPU type (accelerator_type:<KIND>)
        return gpu_type if self.kind == "ray" else "emulated-gpu"

    def launch_flags(self) -> list[str]:
        if self.kind == "local":
            return []
        return ["--ray", self.address, "--ray-gpu-resource", self.gpu_resource,
                "--ray-cpus", str(self.cpus_per_process)]


LOCAL = Backend()


def ray_gpu_pools(backend: Backend) -> Inventory:
    """The GPU pools of a Ray cluster: GPUs per type, from each node's `gpu_resource` count
    and its `accelerator_type:<TYPE>` marker."""
    try:
        import ray
    except ImportError:
        raise UserError("the ray backend needs Ray: pip install 'hetrain[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=backend.address, namespace="hetrain", log_to_driver=False, logging_level="WARNING")
    pools: dict[str, int] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node["Resources"]
        n = int(res.get(backend.gpu_resource, 0))
        types = [k.split(":", 1)[1].lower() for k in res if k.startswith("accelerator_type:")]
        if n and types:
            pools[types[0]] = pools.get(types[0], 0) + n
    if not pools:
        raise UserError(f"the Ray cluster at {backend.address} has no typed GPUs: no node has both "
                        f"{backend.gpu_resource!r} and an accelerator_type:<TYPE> resource")
    return gpu_pools(tuple(pools), tuple(pools.values()), name=f"ray:{backend.address}")


def launch_job(job_dir: Path, world: int, worker_args: list[str], quiet: bool = True,
               backend: Backend = LOCAL, gpu_type: str = "gpu") -> subprocess.Popen:
    """Start one job of `world` ranks with `hetrain launch`; returns the launcher process
    (its output goes to launcher-<world>.log in the job directory when quiet)."""
    import yaml

    cluster = {"name": f"job-{world}", "machines": [
        {"name": f"g{i}", "role": "worker", "device": {"kind": backend.machine_kind(gpu_type)}}
        for i in range(world)]}
    cfile = job_dir / f"cluster-{world}-{gpu_type}.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", *backend.launch_flags(), "--cluster", str(cfile),
           "--mode", "allreduce", "--run-dir", str(job_dir / "run")] + (["--quiet"] if quiet else []) + \
          ["-m", "hetrain.sched.worker", "--job-dir", str(job_dir), *worker_args]
    out = (job_dir / "launcher.log").open("ab") if quiet else subprocess.PIPE
    # the launcher starts with SIGUSR1 blocked and unblocks it once its handler is in place
    # (hetrain.runtime.catch_stop_requests): a stop request sent while Python starts waits
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out,
                                stderr=subprocess.STDOUT)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if quiet:
            out.close()
