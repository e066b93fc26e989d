"""The flat buckets of both torch optimizers: how they are cut, which elements each rank owns, and moving
tensors in and out of them. A bucket of N rows (ZeRO: the set size; DistributedOptimizer: 1) is padded to a
multiple of N; rank r owns row r, which a reducescatter of the bucket hands it and an allgather shares."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch


@dataclasses.dataclass
class Bucket:
    """One fused unit of reduction: ``params`` occupy ``[offsets[i], offsets[i] + numels[i])`` of the flat
    bucket of ``rows * row`` elements; the owner of row ``r`` steps elements ``[r * row, (r + 1) * row)``."""

    name: str
    group: int
    params: list[torch.Tensor]
    offsets: list[int]
    numels: list[int]
    rows: int
    row: int
    dtype: torch.dtype  # the parameters' dtype and device as planned
    device: torch.device
    #: ZeroRedundancyOptimizer's (empty until ``adopt``): the flat bucket the parameters are views of, and this
    #: rank's row of it, stepped by the local optimizer
    values: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    shard: torch.Tensor = dataclasses.field(default_factory=lambda: torch.empty(0))
    grads: Optional[torch.Tensor] = None  # the flat bucket the gradients are views of (None after set_to_none)
    shard_grad: Optional[torch.Tensor] = None  # this rank's averaged row of ``grads``, kept across steps
    _views: tuple = (None, [])  # (the ``grads`` they were cut from, per-parameter views of it)

    @property
    def padded(self) -> int:
        return self.rows * self.row

    def span(self, rank: int) -> tuple[int, int]:
        return rank * self.row, (rank + 1) * self.row

    def adopt(self, rank: int) -> None:
        """Move the parameters into one flat buffer (each becomes a view of it) and take row ``rank`` as the
        shard: the local optimizer then updates this rank's parameters in place, and an allgather into the
        buffer updates the rest. Parameters whose data was replaced since are moved back in."""
        if self.values.numel() == 0:
            self.values = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
            self.shard = self.values.view(self.rows, self.row)[rank]
        for p, view in zip(self.params, self.split(self.values)):
            if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                view.copy_(p.detach())
                p.data = view

    def collect(self, i: Optional[int] = None) -> None:
        """Put the gradient of parameter ``i`` (default: every one; None counts as zeros) into the flat
        gradient buffer, and make ``.grad`` a view of it (a gradient that is one already is left alone)."""
        first = self.params[0].grad
        if self.grads is None and len(self.params) == 1 and first is not None and first.numel() == self.padded \
                and first.is_contiguous() and first.dtype == self.dtype and first.device == self.device:
            self.grads = first.detach().view(-1)  # one unpadded parameter: its gradient is the bucket already
        if self.grads is None:
            self.grads = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            self.grads[self.offsets[-1] + self.numels[-1]:].zero_()  # padding
        views = self.grad_views()
        for j in range(len(self.params)) if i is None else (i,):
            p, view = self.params[j], views[j]
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
                view.copy_(g.reshape(view.shape))
                p.grad = view

    def grad_views(self) -> list[torch.Tensor]:
        """Per-parameter views (parameter shapes) of ``grads``, cut once per buffer."""
        if self._views[0] is not self.grads:
            self._views = (self.grads, self.split(self.grads) if self.grads is not None else [])
        return self._views[1]

    def averaged(self) -> torch.Tensor:
        """The buffer this rank's averaged gradient row goes to (allocated once)."""
        if self.shard_grad is None:
            self.shard_grad = torch.empty(self.row, dtype=self.dtype, device=self.device)
        return self.shard_grad

    def own(self, tensors: Sequence[Optional[torch.Tensor]], rank: int, dtype: torch.dtype) -> torch.Tensor:
        """Row ``rank`` of the bucket built from one tensor per parameter, without building the rest."""
        lo, hi = self.span(rank)
        out = torch.zeros(self.row, dtype=dtype, device=self.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            a, b = max(lo, off), min(hi, off + n)
            if t is not None and a < b:
                out[a - lo:b - lo].copy_(t.reshape(-1)[a - off:b - off])
        return out

    def split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (parameter shapes) of a whole flat bucket."""
        flat = whole.reshape(-1)
        return [flat[off:off + n].view(p.shape) for p, off, n in zip(self.params, self.offsets, self.numels)]


def plan_buckets(group: int, params: list[torch.Tensor], rows: int, cap_bytes: int, uid: str, start: int = 0,
                 first_cap_bytes: Optional[int] = None, unit: Optional[Callable[[torch.Tensor], int]] = None
                 ) -> list[Bucket]:
    """Cut param group ``group``'s trainable ``params``, in the order given, into buckets of ``rows`` rows and at
    most ``cap_bytes`` (a parameter larger than that gets a bucket of its own; 0: one bucket per parameter), one
    dtype and device per bucket, the first bucket capped at ``first_cap_bytes`` (default ``cap_bytes``); or,
    given ``unit``, exactly where the parameters' unit changes (DistributedOptimizer's ``groups=``). Depends only
    on the parameters' shapes, dtypes and order, so every rank of the set computes the same plan from the same
    (agreed) order."""
    buckets: list[Bucket] = []
    current: list[torch.Tensor] = []
    nbytes = 0

    def close() -> None:
        if current:
            numels = [p.numel() for p in current]
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            buckets.append(Bucket(f"{uid}.g{group}.b{start + len(buckets)}", group, list(current), offsets, numels,
                                  rows, max(1, -(-sum(numels) // rows)), current[0].dtype, current[0].device))
        current.clear()

    for p in (p for p in params if p.requires_grad):
        cap = first_cap_bytes if first_cap_bytes is not None and not buckets else cap_bytes
        full = unit(p) != unit(current[0]) if unit is not None and current else \
            nbytes + p.numel() * p.element_size() > cap
        if current and (p.dtype != current[0].dtype or p.device != current[0].device or full):
            close()
            nbytes = 0
        current.append(p)
        nbytes += p.numel() * p.element_size()
    close()
    return buckets
