"""DistributedOptimizer's gradient buckets: each parameter's gradient is a view of a flat bucket; a bucket is
reduced in place, as one operation through its comm hook, once its last gradient is ready.

The layout follows the order in which the first backward pass produced the gradients on the set's first
rank (agreed with one small collective at the first synchronize; DDP rebuilds its buckets the same way),
and is re-planned from that agreed order, without communication, when parameters are frozen, unfrozen,
added, or change dtype, device or shape (``model.to()`` after wrapping).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch

from hvdlite.core import ProcessSet

from .async_ops import Sum, allreduce_
from .comm_hooks import CommHook, GradBucket
from .zero_layout import Bucket, plan_buckets

__all__ = ["BucketSync", "FIRST_BUCKET_BYTES"]

#: The first bucket (the gradients backward produces first) is kept small so that its reduction starts early
#: (DDP uses 1 MiB too); the others are capped by the fusion_threshold_bytes setting.
FIRST_BUCKET_BYTES = 1024 * 1024
#: process set id -> counter of the optimizers built over it (names must agree among the set's members only)
_instances: dict[int, "itertools.count[int]"] = {}


class BucketSync:
    """The buckets of one DistributedOptimizer: layout, submission through the hook, results written back."""

    def __init__(self, process_set: ProcessSet, cap_bytes: int, eligible: Callable[[torch.Tensor], bool]) -> None:
        self.process_set = process_set
        self.cap = int(cap_bytes)
        self.eligible = eligible  # dense, not in a groups= unit, not sparse
        ps_id = process_set.process_set_id or 0
        self.uid = f"grads.ps{ps_id}.{next(_instances.setdefault(ps_id, itertools.count()))}"
        self.hook: Optional[CommHook] = None
        self.state: Any = None
        self.seen: dict[int, int] = {}  # id(param) -> position in the first backward's order (this rank)
        self.sparse_seen: set[int] = set()
        self.order: Optional[list[torch.Tensor]] = None  # agreed order of every parameter (None: not yet)
        self.sparse: set[int] = set()  # ids of parameters some rank saw a sparse gradient for
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[int, int]] = {}
        self.kinds: list[tuple[torch.dtype, torch.device]] = []  # each bucket's dtype and device as planned
        self.ready: list[int] = []
        self.futures: dict[int, tuple[Any, GradBucket]] = {}
        self.signature: tuple = ()
        self.invalid: set[int] = set()  # buckets whose parameters changed dtype, device or size
        self.generation = 0

    # -- layout -------------------------------------------------------------------------------------
    @property
    def agreed(self) -> bool:
        return self.order is not None

    def record(self, p: torch.Tensor) -> None:
        """Note the first backward's order and every parameter seen with a sparse gradient."""
        if self.order is None:
            self.seen.setdefault(id(p), len(self.seen))
        if p.grad is not None and p.grad.is_sparse:
            self.sparse_seen.add(id(p))

    def agree(self, params: list[torch.Tensor]) -> None:
        """One collective: the first rank's order of readiness, and which parameters have sparse gradients
        anywhere. Parameters that rank saw no gradient for follow, in reverse order."""
        n = len(params)
        votes = torch.zeros(2 * n, dtype=torch.int64)
        first = self.process_set.rank() == 0
        for i, p in enumerate(params):
            if first and id(p) in self.seen:
                votes[i] = self.seen[id(p)] + 1
            if id(p) in self.sparse_seen:
                votes[n + i] = 1
        allreduce_(votes, name=f"{self.uid}.layout", op=Sum, process_set=self.process_set)
        position = votes[:n].tolist()
        ranked = sorted((pos, i) for i, pos in enumerate(position) if pos > 0)
        rest = [i for i in reversed(range(n)) if position[i] == 0]
        self.order = [params[i] for _, i in ranked] + [params[i] for i in rest]
        self.sparse = {id(params[i]) for i in range(n) if votes[n + i] > 0}

    def plan(self, params: list[torch.Tensor], signature: tuple) -> None:
        """(Re)build the buckets from the agreed order (parameters added since go last, in reverse order)."""
        assert self.order is not None
        known = {id(p) for p in self.order}
        self.order += [p for p in reversed(params) if id(p) not in known]
        members = {id(p) for p in params}
        chosen = [p for p in self.order if id(p) in members and id(p) not in self.sparse and self.eligible(p)]
        self.generation += 1
        self.buckets = plan_buckets([(0, chosen)], 1, self.cap, f"{self.uid}.v{self.generation}", in_order=True,
                                    first_cap_bytes=min(FIRST_BUCKET_BYTES, self.cap))
        self.kinds = [(b.dtype, b.params[0].device) for b in self.buckets]
        self.where = {id(p): (k, i) for k, b in enumerate(self.buckets) for i, p in enumerate(b.params)}
        self.ready = [0] * len(self.buckets)
        self.signature = signature
        self.invalid = set()

    def fits(self, k: int, i: int, p: torch.Tensor) -> bool:
        """Whether ``p`` still fits its place (same dtype, device and size as when planned)."""
        dtype, device = self.kinds[k]
        return p.dtype == dtype and p.device == device and p.numel() == self.buckets[k].numels[i]

    def check(self, signature: tuple) -> None:
        """At synchronize: which buckets still fit their parameters (all, unless the signature changed)."""
        self.invalid = set() if signature == self.signature else \
            {k for k, b in enumerate(self.buckets) if not all(self.fits(k, i, p) for i, p in enumerate(b.params))}

    def covers(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is reduced by a bucket this step (else by the optimizer's own path)."""
        where = self.where.get(id(p))
        return where is not None and where[0] not in self.invalid

    # -- during backward ----------------------------------------------------------------------------
    def collect(self, p: torch.Tensor) -> bool:
        """Make ``p.grad`` a view of its bucket (copying it in once); False if ``p`` has no valid place."""
        where = self.where.get(id(p))
        if where is None or p.grad is None or p.grad.is_sparse or not self.fits(*where, p):
            return False
        with torch.no_grad():
            self.buckets[where[0]].collect(where[1])
        return True

    def ready_one(self, p: torch.Tensor, overlap: bool) -> bool:
        """``p``'s passes are complete; start its bucket when it was the last. False: not a bucket's."""
        if not self.collect(p):
            return False
        k = self.where[id(p)][0]
        self.ready[k] += 1
        if overlap and self.ready[k] == len(self.buckets[k].params) and k not in self.futures:
            self.submit(k)
        return True

    def submit(self, k: int) -> None:
        bucket = self.buckets[k]
        with torch.no_grad():
            bucket.collect()  # a parameter without a gradient takes part with zeros (peers may have one)
        view = GradBucket(k, bucket, k == len(self.buckets) - 1, self.process_set)
        assert self.hook is not None
        self.futures[k] = (self.hook(self.state, view), view)

    # -- at synchronize -----------------------------------------------------------------------------
    def submit_waiting(self) -> None:
        for k in range(len(self.buckets)):
            if k not in self.futures and k not in self.invalid:
                self.submit(k)

    def finish(self) -> None:
        """Wait for every bucket; its result goes into the buffer and each gradient is a view of it."""
        try:
            for k, (future, view) in sorted(self.futures.items()):
                result = future.wait()
                buffer = view.buffer()
                if result is not buffer:
                    with torch.no_grad():
                        buffer.copy_(result.reshape(-1))
                for p, grad in zip(self.buckets[k].params, self.buckets[k].grad_views()):
                    current = p.grad
                    if current is grad or (current is None and not p.requires_grad):
                        continue  # a view already; or frozen this step: left without a gradient, as in torch
                    if current is None or current.data_ptr() != grad.data_ptr() or current.shape != grad.shape:
                        p.grad = grad
        finally:
            self.futures.clear()
            self.ready = [0] * len(self.buckets)

    def drain(self) -> None:
        """Wait for what is in flight without using it (load_state_dict)."""
        for future, _ in self.futures.values():
            future.wait()
        self.futures.clear()
        self.ready = [0] * len(self.buckets)
