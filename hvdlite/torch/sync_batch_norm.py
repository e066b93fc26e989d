"""SyncBatchNorm: batch normalisation whose batch statistics span every rank (CPU and CUDA)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import sync_moments

from .collectives import grouped_allreduce
from .async_ops import Sum


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the union of every rank's batch (input ``(N, C, ...)``, CPU or CUDA): in training
    the core's sync_moments over ``process_set``, with differentiable allreduces."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or not self.track_running_stats  # else eval with the running statistics
        if not batch_stats or not self.process_set.included() or self.process_set.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, batch_stats,
                                factor, self.eps)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
        x = input.to(torch.promote_types(input.dtype, torch.float32))

        def summed(tensors: list) -> list:  # differentiable: gradients flow back through the allreduce
            return grouped_allreduce(tensors, op=Sum, process_set=self.process_set)
        mean, var, count = sync_moments(x, None, lambda t: t.sum(dims), summed, lambda t: t.view(shape))
        out = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                n = float(count[0]) if count.numel() else 0.0
                unbiased = var.detach() * (n / (n - 1) if n > 1 else 1.0)
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)
