"""Horovod's `hvd.SyncBatchNorm`: batch normalisation over the whole global batch.

In training, each worker's per-channel sum, sum of squares and sample count are summed
over the workers (one all-reduce), so the mean and variance, the normalisation and the
running statistics are those of the global batch: the same as one process on the whole
batch. The backward pass sums the gradients of those statistics over the workers (the
all-reduce's own gradient), so every worker's input gradients are those of the global
loss. Workers may hold different numbers of samples. In evaluation it is a plain
BatchNorm with the (identical) running statistics.

It runs on the workers' transport like the other collectives (gloo for host tensors,
NCCL or a host copy for CUDA ones). PyTorch's `nn.SyncBatchNorm` needs the default
process group, which under hetrain also holds the summation servers; this one uses the
workers' group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _BatchNorm

from .reduce_op import Carrier


class _SumOverWorkers(torch.autograd.Function):
    """y = the sum over workers of x; dx = the sum over workers of dy."""

    @staticmethod
    def forward(ctx, x):
        return _allreduce_sum(x)

    @staticmethod
    def backward(ctx, dy):
        return _allreduce_sum(dy)


def _allreduce_sum(t: torch.Tensor) -> torch.Tensor:
    car = Carrier(t, "SyncBatchNorm")
    if car.ctx.distributed and car.ctx.num_workers > 1:
        car.run(lambda: dist.all_reduce(car.buf, group=car.group))
    return car.back(car.buf)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch (see the module
    docstring). Same arguments as `torch.nn.BatchNorm*d`; any input of shape (N, C, ...)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not (self.training or not self.track_running_stats):
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        stats = torch.cat([xs.sum(dims), (xs * xs).sum(dims), count.to(xs.dtype)])
        total = _SumOverWorkers.apply(stats)
        c = x.shape[1]
        n = total[-1]
        mean = total[:c] / n
        var = total[c: 2 * c] / n - mean * mean
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var.detach() * (n.detach() / (n.detach() - 1).clamp(min=1))
                self.running_mean.mul_(1 - m).add_(mean.detach().to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xs - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


__all__ = ["SyncBatchNorm"]
