"""`hetrain launch`, `hetrain demo`, `hetrain netns cleanup`."""
from __future__ import annotations

import argparse

from ..cluster.spec import load_cluster
from .env import CommConfig
from .topology import MODES


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", help="cluster YAML (default: built-in 4 mixed workers + 2 CPU machines)")
    p.add_argument("--mode", choices=MODES, default="byteps", help="communication architecture (default byteps)")
    p.add_argument("--partition-bytes", type=int, default=4_096_000)
    p.add_argument("--credit-bytes", type=int, default=0, help="bytes in flight per worker over all servers (0: about 256 KiB, at least 2 partitions, per server)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a silent peer is declared lost")
    p.add_argument("--max-lanes", type=int, default=1,
                   help="parallel connections per summation server, proportional to its byte share (default 1)")
    p.add_argument("--codec", default="fp32", choices=["fp32", "fp16", "int8", "int4", "auto"],
                   help="gradient compression with error feedback (auto: by link bandwidth and tensor size)")
    p.add_argument("--codec-rule", action="append", default=[], metavar="GLOB=CODEC",
                   help="per-tensor codec, e.g. '*.bias=fp32' (repeatable, first match wins)")
    p.add_argument("--overlap", action="store_true",
                   help="push each layer's gradient while backward continues (DistributedOptimizer)")
    p.add_argument("--sync", choices=["sync", "async", "stale"], default="sync",
                   help="training mode: synchronous (default), asynchronous, or bounded staleness (--staleness)")
    p.add_argument("--staleness", type=int, default=0,
                   help="with --sync stale: the fastest worker runs at most this many steps ahead of the slowest")
    p.add_argument("--emulate", choices=["none", "netns", "ratelimit", "auto"],
                   help="override the cluster file's link emulation")
    p.add_argument("--run-dir", help="where logs, TensorBoard events and checkpoints go")
    p.add_argument("--quiet", action="store_true", help="do not stream the processes' output")


def _launch_config(args, argv: list[str]):
    from .launcher import LaunchConfig
    from .auth import load_secret

    cluster = load_cluster(args.cluster)
    if args.emulate:
        cluster = cluster.with_emulation(args.emulate)
    comm = CommConfig(mode=args.mode, partition_bytes=args.partition_bytes, credit_bytes=args.credit_bytes,
                      timeout_s=args.timeout, max_lanes=args.max_lanes, codec=args.codec,
                      codec_rules=tuple(args.codec_rule),
                      overlap=args.overlap, sync=args.sync, staleness=args.staleness)
    secret = None
    if getattr(args, "secret_file", None):
        secret = load_secret(path=args.secret_file)
    return LaunchConfig(cluster=cluster, argv=argv, comm=comm, node_rank=getattr(args, "node_rank", None),
                        master_addr=getattr(args, "master_addr", None), master_port=getattr(args, "master_port", 0) or 0,
                        secret=secret, run_dir=args.run_dir, quiet=args.quiet)


def _cmd_launch(args) -> int:
    from .launcher import launch

    argv = (["-m"] if args.module else []) + [args.script, *args.script_args]
    if args.ray:
        from .ray_backend import RayOptions, launch_on_ray

        opts = RayOptions(address=args.ray, gpu_resource=args.ray_gpu_resource, cpus_per_process=args.ray_cpus,
                          strategy=args.ray_strategy, reserve_timeout_s=args.ray_wait)
        return launch_on_ray(_launch_config(args, argv), opts)
    return launch(_launch_config(args, argv))


def _cmd_demo(args) -> int:
    from .launcher import launch

    argv = ["-m", "hetrain.demo.digits", "--epochs", str(args.epochs)]
    return launch(_launch_config(args, argv))


def _cmd_netns(args) -> int:
    from ..cluster.netns import cleanup_stale

    slots = cleanup_stale()
    print(f"removed emulated networks of {len(slots)} dead launcher(s): {slots}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("launch", help="start every worker and summation server of a cluster",
                       description="Start a training script on every worker machine of the cluster, and the "
                                   "summation servers the mode needs. Multi-node: run the same command on every "
                                   "node with --node-rank, --master-addr, --master-port and the same secret.")
    _add_job_flags(p)
    p.add_argument("--node-rank", type=int, help="this node's rank (machines carry `node:` in the cluster file)")
    p.add_argument("--master-addr", help="node 0's cluster address (hosts the rendezvous store)")
    p.add_argument("--master-port", type=int, default=0)
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
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_launch)

    d = sub.add_parser("demo", help="train a digits classifier on the built-in heterogeneous cluster")
    _add_job_flags(d)
    d.add_argument("--epochs", type=int, default=10)
    d.set_defaults(func=_cmd_demo)

    n = sub.add_parser("netns", help="emulated-network housekeeping")
    n.add_argument("action", choices=["cleanup"])
    n.set_defaults(func=_cmd_netns)
