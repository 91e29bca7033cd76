"""hetrain: fast, cheap PyTorch training on heterogeneous clusters.

Communication API (BytePS/Horovod style)::

    import hetrain
    hetrain.init()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    hetrain.broadcast_parameters(model.state_dict(), root_rank=0)
    loader = hetrain.BalancedLoader(dataset, global_batch=256, optimizer=opt, model=model)
    for x, y in loader: ...       # this worker's share, on its device, balanced by measured speed

Elastic training (restart from the last commit, Horovod-style): `hetrain.elastic.State`,
`@hetrain.elastic.run` (the module `hetrain.train.elastic`).
"""
from __future__ import annotations

__version__ = "0.1.0"

_API = {"init", "rank", "size", "local_rank", "local_size", "device", "push_pull", "push_pull_async",
        "poll", "synchronize", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
        "DistributedOptimizer", "Compression", "HookState", "ddp_comm_hook", "shutdown", "engine"}
_TRAIN = {"BalancedLoader", "BalancedBatchSampler"}


def __getattr__(name: str):
    # Lazy: `hetrain plan` and `hetrain schedule` must not pay for torch.distributed.
    if name in _API:
        from . import api
        return getattr(api, name)
    if name in _TRAIN:
        from .train import loader
        return getattr(loader, name)
    if name == "elastic":
        import importlib
        return importlib.import_module("hetrain.train.elastic")
    raise AttributeError(f"module 'hetrain' has no attribute {name!r}")


__all__ = sorted(_API | _TRAIN | {"elastic"})
