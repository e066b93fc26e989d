"""The one bucket machine of both torch optimizers: each gradient a view of a flat bucket, counted as backward
makes it ready, each bucket reduced by its optimizer's collective (HookAllreduce, AdasumDeltas or
ShardReducescatter) once its last gradient is ready."""
from __future__ import annotations

import itertools
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from hvdlite.core import ProcessSet

from .async_ops import Adasum, Average, Sum, allreduce_
from .buckets import Bucket, plan_buckets
from .comm_hooks import CommHook, GradBucket, Reduction, decompressed, start_reduction, write_back

__all__ = ["BucketSync", "BucketCollective", "HookAllreduce", "AdasumDeltas", "ShardReducescatter",
           "FIRST_BUCKET_BYTES"]

#: The first bucket (the gradients backward produces first) is kept small so that its reduction starts early
#: (DDP uses 1 MiB too); the others are capped by the fusion_threshold_bytes setting.
FIRST_BUCKET_BYTES = 1024 * 1024
#: (kind, process set id) -> counter of the bucket machines built over it (names must agree among the set's
#: members only)
_instances: dict[tuple[str, int], "itertools.count[int]"] = {}


class BucketCollective(Protocol):
    """How one optimizer's buckets are reduced: ``start`` buckets ``ks`` (one request, returning what has a
    ``wait()``), ``finish`` them."""

    #: whether several buckets may go as one request (submitted together when not overlapping)
    groups: bool

    def start(self, buckets: list[Bucket], ks: list[int]) -> Any: ...

    def finish(self, chosen: list[Bucket], started: Any) -> None: ...


def _request_name(chosen: list[Bucket]) -> str:
    return chosen[0].name + (f".x{len(chosen)}" if len(chosen) > 1 else "")


class HookAllreduce:
    """In-place allreduce of each bucket through the comm hook ``hook(state, GradBucket) -> future``."""

    groups = False  # the hook protocol takes one bucket

    def __init__(self, process_set: ProcessSet, hook: Optional[CommHook]) -> None:
        self.process_set = process_set
        self.hook = hook
        self.state = None

    def start(self, buckets: list[Bucket], ks: list[int]) -> Any:
        (k,) = ks
        assert self.hook is not None
        return self.hook(self.state, GradBucket(k, buckets[k], k == len(buckets) - 1, self.process_set))

    def finish(self, chosen: list[Bucket], started: Any) -> None:
        """The hook's result goes into the bucket's buffer and each gradient is a view of it."""
        bucket, result = chosen[0], started.wait()
        assert bucket.grads is not None
        if result is not bucket.grads:  # (reduced in place, as the default hook does: no no_grad(), 4.6 us a bucket)
            with torch.no_grad():
                write_back(bucket.grads, result)
        for p, grad in zip(bucket.params, bucket.grad_views()):
            current = p.grad
            if current is grad or (current is None and not p.requires_grad):
                continue  # a view already; or frozen this step: left without a gradient, as in torch
            if current is None or current.data_ptr() != grad.data_ptr() or current.shape != grad.shape:
                p.grad = grad


class _Deltas(NamedTuple):
    params: list[torch.Tensor]
    starts: list[torch.Tensor]  # each parameter's value before the local step
    reduction: Reduction

    def wait(self) -> Any:
        return self.reduction.wait()


class AdasumDeltas:
    """Horovod's Adasum delta scheme per bucket: the wrapped optimizer steps the bucket's parameters locally
    (``local_step``), their deltas are combined with Adasum (each parameter its own vector, one grouped
    allreduce), and each parameter becomes its start plus the combined delta. Gradients stay where autograd
    put them (the optimizer's BucketSync is not ``flat``)."""

    groups = True  # without overlap: one local step and one request for every bucket

    def __init__(self, process_set: ProcessSet, compression: Any,
                 local_step: Callable[[list[torch.Tensor]], None]) -> None:
        self.process_set = process_set
        self.compression = compression
        self.local_step = local_step

    def start(self, buckets: list[Bucket], ks: list[int]) -> _Deltas:
        chosen = [buckets[k] for k in ks]
        params = [p for b in chosen for p in b.params if p.requires_grad]
        with torch.no_grad():  # a parameter without a gradient is not stepped: its delta is zero, as in Horovod
            starts = [p.detach().clone() for p in params]
            self.local_step(params)
            deltas = [(p.detach() - s).contiguous() for p, s in zip(params, starts)]
        return _Deltas(params, starts, start_reduction(deltas, self.compression, _request_name(chosen), Adasum,
                                                       1.0, 1.0, self.process_set))

    def finish(self, chosen: list[Bucket], started: _Deltas) -> None:
        started.wait()
        with torch.no_grad():
            for p, start, delta in zip(started.params, started.starts, decompressed(started.reduction)):
                p.copy_(start + delta.to(start.dtype))


class ShardReducescatter:
    """Average each bucket's gradients, viewed as one row per rank, into this rank's shard (``averaged()``,
    kept across steps; the shard's ``.grad``)."""

    groups = True

    def __init__(self, process_set: ProcessSet, compression: Any) -> None:
        self.process_set = process_set
        self.compression = compression

    def start(self, buckets: list[Bucket], ks: list[int]) -> Reduction:
        chosen = [buckets[k] for k in ks]
        wholes = [b.grads.view(b.rows, b.row) for b in chosen]  # type: ignore[union-attr]
        return start_reduction(wholes, self.compression, _request_name(chosen), Average, 1.0, 1.0,
                               self.process_set, scatter_into=[b.averaged().view(1, -1) for b in chosen])

    def finish(self, chosen: list[Bucket], started: Reduction) -> None:
        started.wait()
        for bucket, row in zip(chosen, decompressed(started)):
            write_back(bucket.averaged(), row)
            bucket.shard.grad = bucket.averaged()


class _Started(NamedTuple):
    chosen: list[Bucket]  # the buckets of one request
    started: Any  # what the collective's start returned


class BucketSync:
    """The buckets of one optimizer: layout, readiness counts, submission through the collective, finishing."""

    def __init__(self, collective: BucketCollective, process_set: ProcessSet, kind: str, cap_bytes: int, *,
                 agreed: bool = False, flat: bool = True, unit: Optional[Callable[[torch.Tensor], int]] = None
                 ) -> None:
        self.collective = collective
        self.process_set = process_set
        self.cap = int(cap_bytes)  # 0 (fusion off): one bucket per parameter
        #: gradients move into the flat buffers (sparse ones are left to the optimizer); False (Adasum): the
        #: buckets only group the parameters, gradients of any layout stay where autograd put them
        self.flat = flat
        self.unit = unit  # groups=: each parameter's unit, the explicit bucket boundaries
        ps_id = process_set.process_set_id or 0
        self.uid = f"{kind}.ps{ps_id}.{next(_instances.setdefault((kind, ps_id), itertools.count()))}"
        self.seen: dict[int, int] = {}  # id(param) -> position in the first backward's order (this rank)
        self.sparse_seen: set[int] = set()
        #: agreed order of every parameter (None: not agreed yet; [] for a layout fixed when built)
        self.order: Optional[list[torch.Tensor]] = [] if agreed else None
        self.sparse: set[int] = set()  # ids of parameters some rank saw a sparse gradient for (flat only)
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position in it)
        self.ready: list[int] = []  # per bucket: how many of its gradients are complete this step
        self.inflight: dict[int, _Started] = {}  # bucket -> its started request
        self.signature: tuple = ()
        self.generation = 0

    # -- layout -------------------------------------------------------------------------------------
    @property
    def agreed(self) -> bool:
        return self.order is not None

    def extend(self, group: int, params: list[torch.Tensor], rows: int) -> list[Bucket]:
        """Add buckets of ``rows`` rows for param group ``group``'s trainable parameters (a fixed layout, in
        reverse order: the order backward produces gradients)."""
        new = plan_buckets(group, params[::-1], rows, self.cap, self.uid, start=len(self.buckets))
        self._place(self.buckets + new)
        return new

    def plan(self, params: list[torch.Tensor], signature: tuple) -> None:
        """(Re)build the buckets from the agreed order (parameters added since go last, in reverse order)."""
        self._place(self._cut(params))
        self.signature = signature

    def refit(self, params: list[torch.Tensor], signature: tuple) -> None:
        """At synchronize, when ``params`` changed since the plan: the buckets that no longer fit their
        parameters, and trainable parameters without a place, are planned afresh (after the others, which
        may be in flight) before anything of theirs is submitted. Each rank decides from its own parameters,
        changed alike on every rank as the model is."""
        if signature == self.signature:
            return
        keep = [b for k, b in enumerate(self.buckets)
                if k in self.inflight or all(self.fits(k, i, p) for i, p in enumerate(b.params))]
        placed = {id(p) for b in keep for p in b.params}
        at = {id(b): k for k, b in enumerate(keep)}
        self.inflight = {at[id(self.buckets[k])]: started for k, started in self.inflight.items()}
        self._place(keep + self._cut([p for p in params if id(p) not in placed]))

    def _cut(self, params: list[torch.Tensor]) -> list[Bucket]:
        """New buckets for ``params`` in the agreed order: ``groups=`` units whole, in the order of their first
        member; else cut by size, the first bucket small."""
        assert self.order is not None
        known = {id(p) for p in self.order}
        self.order += [p for p in reversed(params) if id(p) not in known]
        members = {id(p) for p in params}
        chosen = [p for p in self.order if id(p) in members and id(p) not in self.sparse]
        if self.unit is not None:
            first: dict[int, int] = {}
            for i, p in enumerate(chosen):
                first.setdefault(self.unit(p), i)
            chosen.sort(key=lambda p: first[self.unit(p)])  # type: ignore[misc]
        self.generation += 1
        return plan_buckets(0, chosen, 1, self.cap, f"{self.uid}.v{self.generation}",
                            first_cap_bytes=min(FIRST_BUCKET_BYTES, self.cap), unit=self.unit)

    def _place(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self.where = {id(p): (k, i) for k, b in enumerate(buckets) for i, p in enumerate(b.params)}
        self.ready = [0] * len(buckets)

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
        if self.flat:
            self.sparse = {id(params[i]) for i in range(n) if votes[n + i] > 0}

    def fits(self, k: int, i: int, p: torch.Tensor) -> bool:
        """Whether ``p`` still fits its place (same dtype, device and size as when planned)."""
        b = self.buckets[k]
        return p.dtype == b.dtype and p.device == b.device and p.numel() == b.numels[i]

    # -- during backward ----------------------------------------------------------------------------
    def take(self, p: torch.Tensor, complete: bool, overlap: bool) -> bool:
        """``p``'s gradient after a backward pass (the optimizer's gradient-ready hook): it moves into its bucket
        (once; later passes, such as no_sync()'s, accumulate in place), and when ``complete`` makes the bucket
        complete, the bucket's reduction starts (if ``overlap``). Before the layout is agreed everything waits
        for it (True); False: ``p`` has no place that fits (a sparse gradient, or a change that synchronize's
        ``refit`` plans for)."""
        if self.order is None:  # the first backward's order, and the parameters seen with a sparse gradient
            self.seen.setdefault(id(p), len(self.seen))
            if p.grad is not None and p.grad.is_sparse:
                self.sparse_seen.add(id(p))
            return True
        where = self.where.get(id(p))
        if where is None:
            return False
        k, i = where
        bucket, grad = self.buckets[k], p.grad
        if self.flat and grad is not None:
            views = bucket.grad_views()
            if not views or grad is not views[i]:  # (from the second step on it is that view, which fits: nothing)
                if grad.is_sparse or not self.fits(k, i, p):
                    return False
                with torch.no_grad():
                    bucket.collect(i)
        if complete:
            self.ready[k] += 1
            if overlap and self.ready[k] == len(bucket.params) and k not in self.inflight:
                self.submit([k])
        return True

    def submit(self, ks: list[int]) -> None:
        """Start the reduction of buckets ``ks`` as one request (their gradients are in place)."""
        started = _Started([self.buckets[k] for k in ks], self.collective.start(self.buckets, ks))
        for k in ks:
            self.inflight[k] = started

    # -- at step / synchronize ----------------------------------------------------------------------
    def submit_waiting(self, overlap: bool) -> None:
        """Start every bucket backward has not started: one request each when overlapping (the names do not
        depend on what backward started) or when the collective takes one bucket, else one for all. Their
        gradients are collected first: one replaced since backward is copied in, a missing one counts as
        zeros (peers may have one)."""
        waiting = [k for k in range(len(self.buckets)) if k not in self.inflight]
        if self.flat:
            with torch.no_grad():
                for k in waiting:
                    self.buckets[k].collect()
        if overlap or not self.collective.groups:
            for k in waiting:
                self.submit([k])
        elif waiting:
            self.submit(waiting)

    def finish(self, use: bool = True) -> None:
        """Wait for every started request and let the collective put its results in place; without ``use``
        (load_state_dict) the results are dropped."""
        try:
            requests = list({id(s): s for _, s in sorted(self.inflight.items())}.values())  # each request once
            for started in reversed(requests):  # the last first: this thread wakes once, not once per bucket
                started.started.wait()
            for started in requests if use else ():
                self.collective.finish(started.chosen, started.started)
        finally:
            self.reset()

    def reset(self) -> None:
        """A step's reductions are done (or dropped): nothing in flight, nothing counted."""
        self.inflight.clear()
        self.recount()

    def recount(self) -> None:
        """Count complete gradients afresh (the passes are counted afresh); what is in flight stays, for the
        next step to finish."""
        self.ready = [0] * len(self.buckets)
