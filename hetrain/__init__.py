"""hetrain: fast, cheap PyTorch training on heterogeneous clusters.

Communication API (BytePS/Horovod style)::

    import hetrain
    hetrain.init()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    hetrain.broadcast_parameters(model.state_dict(), root_rank=0)
    loader = hetrain.BalancedLoader(dataset, global_batch=256, optimizer=opt, model=model)
    for x, y in loader: ...       # this worker's share, on its device, balanced by measured speed

Horovod and BytePS scripts run with their import line changed (`import hetrain as hvd`):
the collectives, DistributedOptimizer's options and Horovod Elastic's names are here
(docs/porting.md lists every name and its status).

Models larger than the smallest device: `hetrain.shard(model, optimizer,
hetrain.ShardConfig(stage=3))` shards parameters, gradients and optimizer state unevenly,
by each worker's memory (docs/sharding.md).

Elastic training (restart from the last commit, Horovod-style): `hetrain.elastic.State`
or `hetrain.elastic.TorchState`, `@hetrain.elastic.run` (the module `hetrain.elastic`).
"""
from __future__ import annotations

__version__ = "0.1.0"

# the public API (hetrain/api/), exported lazily: `hetrain plan` and `hetrain schedule`
# must not pay for torch.distributed
_API = {"alltoall_async", "reducescatter_async", "grouped_allgather", "grouped_allgather_async",
        "grouped_reducescatter", "grouped_reducescatter_async", "Adasum", "Average", "Compression", "DistributedOptimizer", "HookState", "Max", "Min", "Product",
        "ReduceOp", "Sum", "SyncBatchNorm", "allgather", "allgather_async", "allgather_object", "allreduce",
        "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "barrier", "broadcast", "broadcast_",
        "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
        "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "ddp_comm_hook", "declare", "device", "engine", "gloo_built", "gloo_enabled", "grouped_allreduce",
        "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "init", "is_homogeneous",
        "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
        "nccl_built", "poll", "push_pull", "push_pull_async", "push_pull_inplace", "rank", "reducescatter",
        "resume", "rocm_built", "shutdown", "size", "suspend", "synchronize"}
_TRAIN = {"BalancedLoader", "BalancedBatchSampler"}
_SHARD = {"shard", "ShardConfig", "MemoryCap"}  # sharded data parallelism (hetrain/train/shard/)

# Horovod and BytePS names hetrain does not provide, with what to use instead
_INSTEAD = {
    "ProcessSet": "process sets are not supported: collectives run on all workers; a subgroup's push_pull is "
                  "hetrain.comm.PushPull(ctx, group)",
    "add_process_set": "process sets are not supported (see ProcessSet)",
    "remove_process_set": "process sets are not supported (see ProcessSet)",
    "global_process_set": "process sets are not supported: leave process_set= out (all workers)",
    "sparse_allreduce_async": "hetrain.allreduce_async on the dense tensor (DistributedOptimizer: "
                              "sparse_as_dense=True)",
    "start_timeline": "hetrain has no timeline; per-step communication times are in the run's step summary "
                      "(<run_dir>) and engine().stats",
    "stop_timeline": "hetrain has no timeline; see engine().stats",
    "get_pushpull_speed": "hetrain.engine().stats (bytes and seconds per step)",
    "mpi_lib_v2": "hetrain never uses MPI: hetrain.gloo_built() / nccl_built()",
    "mpi_ops": "the collectives are at the top level: hetrain.allreduce, hetrain.push_pull_async, ...",
    "Join": "hetrain.join() (call it when this worker runs out of data)",
    "ElasticSampler": "hetrain.elastic.ElasticSampler",
    "TorchState": "hetrain.elastic.TorchState",
    "run": "hetrain.elastic.run",
}


def _nearest(name: str) -> str:
    if name in _INSTEAD:
        return _INSTEAD[name]
    import difflib

    close = difflib.get_close_matches(name, sorted(_API | _TRAIN | _SHARD | {"elastic"}), n=3, cutoff=0.6)
    if close:
        return "the nearest hetrain calls: " + ", ".join(f"hetrain.{c}" for c in close)
    return "see docs/porting.md for the Horovod and BytePS names hetrain provides"


def __getattr__(name: str):
    if name in _API:
        from . import api
        return getattr(api, name)
    if name in _TRAIN:
        from .train import loader
        return getattr(loader, name)
    if name in _SHARD:
        import importlib
        return getattr(importlib.import_module("hetrain.train.shard"), name)
    if name == "elastic":
        import importlib
        return importlib.import_module("hetrain.elastic")
    if name.startswith("__"):  # dunder probes (copy, pickle, doctest...): the plain error
        raise AttributeError(f"module 'hetrain' has no attribute {name!r}")
    raise AttributeError(f"module 'hetrain' has no attribute {name!r}; {_nearest(name)}")


__all__ = sorted(_API | _TRAIN | _SHARD | {"elastic"})
