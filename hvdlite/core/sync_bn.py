"""SyncBatchNorm's statistics over a process set, written once for every framework's tensors."""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

#: A framework's tensor type (arithmetic on it is the framework's own; the checker sees Any).
T = TypeVar("T", bound=Any)

__all__ = ["sync_moments"]


def sync_moments(x: T, weights: Optional[T], sum_over: Callable[[T], T],
                 grouped_allreduce_sum: Callable[[list[Any]], list[Any]], expand: Callable[[T], T]) -> tuple[T, T, T]:
    """SyncBatchNorm's statistics over every rank of a process set, in two passes (numerically stable):
    the global mean first, then the mean of squared deviations from it.

    Works on any framework's tensors: ``sum_over`` sums over the batch (and spatial) axes, ``expand`` makes
    per-channel values broadcast against ``x``, ``grouped_allreduce_sum`` sums a list of tensors across the
    set (differentiably, so gradients flow through it). ``weights`` (a mask, or None) weights each element.
    Returns (mean, biased variance, element count per channel).
    """
    weighted = x if weights is None else x * weights
    count = sum_over(x ** 0) if weights is None else sum_over(weights)  # x ** 0 is 1 even for inf and nan
    total, n = grouped_allreduce_sum([sum_over(weighted), count])
    mean = total / n
    centred = x - expand(mean)
    squares = centred * centred if weights is None else centred * centred * weights
    (var_sum,) = grouped_allreduce_sum([sum_over(squares)])
    return mean, var_sum / n, n
