"""`hetrain launch`, `hetrain demo`, `hetrain netns cleanup`."""
from __future__ import annotations

import argparse
from typing import get_args

from ..cluster.spec import load_cluster
from ..errors import UserError
from ..modes import Sync
from .env import CODEC_CHOICES, CommConfig, GlooThread, ServerLink
from .topology import MODES


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    from .launch.heap import HeapPolicy  # the launcher's package loads when a launch runs

    p.add_argument("--cluster", help="cluster YAML (default: built-in 4 mixed workers + 2 CPU machines)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="communication architecture (default byteps; allreduce for a cluster given by "
                        "--nnodes/--nproc-per-node)")
    p.add_argument("--partition-bytes", type=int, default=4_096_000)
    p.add_argument("--credit-bytes", type=int, default=0, help="bytes in flight per worker over all servers (0: about 256 KiB, at least 2 partitions, per server)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer is declared lost")
    p.add_argument("--max-lanes", type=int, default=1,
                   help="parallel connections per summation server, proportional to its byte share (default 1)")
    p.add_argument("--codec", default="fp32", choices=CODEC_CHOICES,
                   help="gradient compression with error feedback (auto: by link bandwidth and tensor size)")
    p.add_argument("--codec-rule", action="append", default=[], metavar="GLOB=CODEC",
                   help="per-tensor codec, e.g. '*.bias=fp32' (repeatable, first match wins)")
    p.add_argument("--overlap", action="store_true",
                   help="push each layer's gradient while backward continues (DistributedOptimizer)")
    p.add_argument("--sync", choices=[s.value for s in Sync], default="sync",
                   help="training mode: synchronous (default), asynchronous, or bounded staleness (--staleness)")
    p.add_argument("--staleness", type=int, default=0,
                   help="with --sync stale: the fastest worker runs at most this many steps ahead of the slowest")
    p.add_argument("--collective", choices=["auto", "gloo", "nccl"], default="auto",
                   help="worker collectives on GPUs: auto (NCCL where every worker has a GPU of its own), gloo, nccl")
    p.add_argument("--buckets", choices=["tuned", "ddp"], default="tuned",
                   help="all-reduce buckets: tuned (default: DDP's sizes, then larger ones, each for a few steps; "
                        "the fastest measured is kept) or ddp (a 1 MiB first bucket, then 25 MiB)")
    p.add_argument("--gloo-thread", choices=get_args(GlooThread), default="auto",
                   help="gloo's socket threads: auto (default: run them only on core time compute leaves, on the "
                        "workers of an all-reduce job pinned to cores of their own that compute fills), idle "
                        "(always), normal (as gloo starts them)")
    p.add_argument("--server-link", choices=get_args(ServerLink), default="auto",
                   help="a worker and a summation server on one host: auto (default: their partitions and sums "
                        "go through shared memory) or gloo (TCP loopback, as between hosts)")
    p.add_argument("--heap", choices=get_args(HeapPolicy), default="keep",
                   help="the processes' C heap: keep (default: a step's freed memory stays mapped for the next "
                        "one instead of being faulted in again; resident memory stays at its peak) or system "
                        "(the allocator as the machine configures it)")
    p.add_argument("--emulate", choices=["none", "netns", "ratelimit", "auto"],
                   help="override the cluster file's link emulation")
    p.add_argument("--run-dir", help="where logs, TensorBoard events and checkpoints go")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="restart the job from its last commit after up to N failures (a process that died or "
                        "stopped answering); 0 (default) ends the job at the first failure")
    p.add_argument("--min-workers", type=int, default=1,
                   help="give up when fewer worker machines than this are left (machines that fail twice in a "
                        "row are left out until healthy again)")
    p.add_argument("--rejoin-after", type=float, default=60.0, metavar="SECONDS",
                   help="cool-down before a left-out machine is tried again (doubles each time it is left out)")
    p.add_argument("--quiet", action="store_true", help="do not stream the processes' output")


def _add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's flags (both spellings), so a torchrun line runs with `torchrun`
    replaced by `hetrain launch`; runtime/torchrun.py maps them onto a cluster."""
    t = p.add_argument_group("torchrun flags", "without --cluster, --nnodes N --nproc-per-node P is N nodes of P "
                                               "worker processes each (mode allreduce unless --mode is given); "
                                               "with --cluster they must agree with the file")
    t.add_argument("--nnodes", type=str, help="number of nodes (N, or MIN:MAX with MIN = MAX)")
    t.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=str,
                   help="worker processes per node: a number, gpu, cpu or auto")
    t.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                   help="this node's rank (machines carry `node:` in a cluster file); without it, nodes of a "
                        "--nnodes job take ranks in order of arrival")
    t.add_argument("--master-addr", "--master_addr", dest="master_addr",
                   help="node 0's cluster address (hosts the rendezvous store)")
    t.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                   help="rendezvous port (default: a free one on one node, 29500 across nodes)")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", metavar="HOST[:PORT]",
                   help="the same as --master-addr/--master-port (port 29400 when left out)")
    t.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", choices=["c10d", "static"], default="c10d",
                   help="accepted for torchrun lines; hetrain always uses its own store on node 0")
    t.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", help="job id (shown in logs, passed as HETRAIN_JOB_ID)")
    t.add_argument("--standalone", action="store_true", help="one node, rendezvous on a free local port")


def launch_config(args, argv: list[str], cluster=None):
    """The `LaunchConfig` of parsed `launch` (or `demo`) flags: the cluster (given, or
    resolved from torchrun's flags), its communication settings, rendezvous and elastic
    policy; `argv` is the training command. Everything here is checked without importing
    torch (the launcher's agent does), so a mistake is answered at once; the commands
    check the entry point first (`check_entry_point`, torch-free too)."""
    from .launch.config import LaunchConfig
    from .auth import load_secret
    from .supervisor import ElasticConfig
    from .allocation import apply as apply_allocation
    from .torchrun import TorchrunFlags, parse_nnodes, parse_nproc, resolve

    nproc = parse_nproc(args.nproc_per_node) if getattr(args, "nproc_per_node", None) else None
    flags = TorchrunFlags(
        nnodes=parse_nnodes(args.nnodes) if getattr(args, "nnodes", None) else None,
        nproc_per_node=nproc.count if nproc else None, cuda=bool(nproc and nproc.cuda),
        node_rank=getattr(args, "node_rank", None), master_addr=getattr(args, "master_addr", None),
        master_port=getattr(args, "master_port", None), rdzv_endpoint=getattr(args, "rdzv_endpoint", None),
        rdzv_backend=getattr(args, "rdzv_backend", "c10d"), standalone=getattr(args, "standalone", False))
    cluster = cluster or (load_cluster(args.cluster) if args.cluster else None)
    alloc = None
    if not getattr(args, "ray", None):  # inside a Slurm / Kubeflow allocation: where to meet, from its variables
        flags, alloc = apply_allocation(flags, cluster_file=cluster is not None)
        if alloc is not None:
            if cluster is not None and getattr(args, "nnodes", None) is None and cluster.nnodes != alloc.nnodes:
                raise UserError(f"this {alloc.source} allocation has {alloc.nnodes} nodes, but the cluster file puts "
                                f"its machines on {cluster.nnodes} node(s) (`node:`); number the file's nodes "
                                f"0..{alloc.nnodes - 1}, or ask the allocation for {cluster.nnodes} node(s)")
            print(f"hetrain: rendezvous from the environment ({alloc.describe()})", flush=True)
    res = resolve(flags, cluster, args.mode)
    cluster = res.cluster
    if args.emulate:
        cluster = cluster.with_emulation(args.emulate)
    comm = CommConfig(mode=res.mode, partition_bytes=args.partition_bytes, credit_bytes=args.credit_bytes,
                      timeout_s=args.timeout, max_lanes=args.max_lanes, codec=args.codec,
                      codec_rules=tuple(args.codec_rule),
                      overlap=args.overlap, sync=args.sync, staleness=args.staleness, collective=args.collective,
                      buckets=args.buckets, gloo_thread=args.gloo_thread,
                      server_link=args.server_link)
    secret = None
    if getattr(args, "secret_file", None):
        secret = load_secret(path=args.secret_file)
    return LaunchConfig(cluster=cluster, argv=argv, comm=comm, node_rank=res.node_rank,
                        master_addr=res.master_addr, master_port=res.master_port,
                        assign_node_rank=res.assign_node_rank, secret=secret, run_dir=args.run_dir,
                        quiet=args.quiet, job_id=getattr(args, "rdzv_id", None) or (alloc.job_id if alloc else None),
                        heap=args.heap,
                        elastic=ElasticConfig(max_restarts=args.max_restarts, min_workers=args.min_workers,
                                              rejoin_after_s=args.rejoin_after))


def script_argv(args) -> list[str]:
    """The training command of parsed `launch` flags: SCRIPT and its arguments (`-m`: a
    module), or [] when none was given."""
    return (["-m"] if args.module else []) + [args.script, *args.script_args] if args.script else []


def _cmd_launch(args) -> int:
    from .launch import launch
    from .launch.preflight import check_entry_point

    argv = script_argv(args)
    if not argv:
        raise UserError("nothing to launch: give a script (`hetrain launch train.py`) or `-m module`")
    cfg = launch_config(args, argv)  # the flags and the cluster file first, then the script: all torch-free
    check_entry_point(argv)  # a typo is answered before torch is imported
    if args.ray:
        from .ray_backend import RayOptions, launch_on_ray

        opts = RayOptions(address=args.ray, gpu_resource=args.ray_gpu_resource, cpus_per_process=args.ray_cpus,
                          strategy=args.ray_strategy, reserve_timeout_s=args.ray_wait)
        return launch_on_ray(cfg, opts)
    return launch(cfg)


def _cmd_demo(args) -> int:
    """Without --cluster: this host's GPU plus CPU workers where CUDA is available (real
    devices, real compute), else the built-in cluster of emulated speeds."""
    from .launch import launch

    argv = ["-m", "hetrain.demo.digits", "--epochs", str(args.epochs), "--balance", args.balance]
    cluster = None
    if args.cluster is None:
        import torch

        if torch.cuda.is_available():
            from ..cluster.spec import gpu_demo_cluster

            cluster = gpu_demo_cluster()
            argv += ["--cost-per-sample", "0"]  # real devices: no calibrated emulation
    return launch(launch_config(args, argv, cluster))


def _cmd_netns(args) -> int:
    from ..cluster.netns import cleanup_stale

    slots = cleanup_stale()
    print(f"removed emulated networks of {len(slots)} dead launcher(s): {slots}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("launch", help="start every worker and summation server of a cluster",
                       description="Start a training script on every worker machine of the cluster, and the "
                                   "summation servers the mode needs. Multi-node: run the same command on every "
                                   "node with --node-rank, --master-addr, --master-port and the same secret; inside "
                                   "a Slurm step (srun) or a Kubeflow TrainJob/PyTorchJob pod these come from the "
                                   "environment (docs/deploy.md). "
                                   "torchrun's flags work too: `torchrun ARGS train.py` runs as "
                                   "`hetrain launch ARGS train.py`.")
    _add_job_flags(p)
    _add_torchrun_flags(p)
    p.add_argument("--secret-file", help="file holding the job's shared secret (or set HETRAIN_SECRET)")
    r = p.add_argument_group("Ray cluster (pip install 'hetrain[ray]')")
    r.add_argument("--ray", metavar="ADDRESS",
                   help="run the job's processes as actors on this Ray cluster (GCS HOST:PORT, or auto); "
                        "Ray places the machines, this command hosts the rendezvous")
    r.add_argument("--ray-gpu-resource", default="GPU",
                   help="Ray resource that counts GPUs (default GPU; a custom resource for emulated GPUs)")
    r.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs reserved per process (default 1)")
    r.add_argument("--ray-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], default="PACK",
                   help="placement group strategy (default PACK: fewest nodes)")
    r.add_argument("--ray-wait", type=float, default=120.0,
                   help="seconds to wait for the cluster to grant the resources before giving up")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as `python -m` does")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_launch)

    d = sub.add_parser("demo", help="train a digits classifier on the built-in heterogeneous cluster",
                       description="Train a digits classifier. Without --cluster: on this host's GPU plus 3 CPU "
                                   "workers and 2 CPU summation servers where CUDA is available, else on the "
                                   "built-in cluster of 4 emulated workers (speeds 1, 1, 0.5, 0.25) and 2 CPU "
                                   "machines.")
    _add_job_flags(d)
    d.add_argument("--epochs", type=int, default=10)
    d.add_argument("--balance", choices=["measured", "equal"], default="measured",
                   help="batch shares: follow each worker's measured samples/s (default) or equal, to compare")
    d.set_defaults(func=_cmd_demo)

    n = sub.add_parser("netns", help="emulated-network housekeeping")
    n.add_argument("action", choices=["cleanup"])
    n.set_defaults(func=_cmd_netns)
