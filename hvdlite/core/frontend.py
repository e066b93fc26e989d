"""The documented interface between the core and the framework frontends: what they may use beyond the
public API (``hvdlite.core``'s exports and the public ``hvdlite.core.elastic`` package). Every other core
module is private to the core.

- ``resolve_op(op, average=None)`` / ``check_reduction(kind, name, op, dtypes, scaled)``: op resolution and
  the shared submit checks, so both frontends accept and refuse the same things.
- ``then(handle, convert)``: a handle whose ``wait()`` returns ``convert(result)``.
- ``gradient_overlap(compute_threads)``: whether gradient reductions start during backward (decided by the
  ``gradient_overlap`` setting; see Config).
- ``process_set_ranks(ps_id)``: the members of a registered process set, by id.
- ``setting(name)``: the value of one setting of the running job (Config field).
- ``stage_host_copies()``: whether CPU tensors take the device tensors' host-staging path (a test switch).
- ``bf16_to_f32`` / ``f32_to_bf16``: bfloat16 bit conversions for frameworks without a numpy bfloat16.
- ``aligned_empty(shape, dtype)``: an uninitialised array starting on a 64-byte boundary, which TensorFlow
  wraps without copying.
- ``logger``: the rank-prefixed ``hvdlite`` logger.
- ``check_sparse`` / ``sparse_allgather_async``: sparse gradients combined by allgather, as Horovod does.
- ``sync_moments``: the one SyncBatchNorm algorithm (two passes, any process set) on any framework's tensors.
- ``check_named_replicas(named, process_set)`` / ``flatten_tensors(obj, leaf)``: the replica-divergence check
  on (name, numpy array) pairs, and the walk that names the tensors of a nested collection.
- ``basics()``: the runtime names (init, rank, size, process sets, errors, ops...) every frontend re-exports.
"""
from __future__ import annotations

from typing import Any, Callable

from .diagnostics.replicas import check_named as check_named_replicas
from .diagnostics.replicas import flatten as flatten_tensors
from .engine.fusion import aligned_empty
from .engine.handles import Handle
from .log import logger
from .policy import basics, check_sparse, sparse_allgather_async, sync_moments
from .reduce_ops import bf16_to_f32, check_reduction, f32_to_bf16, resolve_op
from .runtime import gradient_overlap, stage_host_copies, state

__all__ = ["resolve_op", "check_reduction", "then", "gradient_overlap", "process_set_ranks", "setting",
           "bf16_to_f32", "f32_to_bf16", "logger", "Handle", "check_sparse", "sparse_allgather_async",
           "sync_moments", "basics", "stage_host_copies", "aligned_empty",
           "check_named_replicas", "flatten_tensors"]


def then(handle: Handle, convert: Callable[[Any], Any]) -> Handle:
    """Make ``handle.wait()`` return ``convert(result)``; returns the same handle."""
    return handle.then(convert)


def process_set_ranks(ps_id: int) -> list[int]:
    """Members (global ranks) of the registered process set ``ps_id``; ValueError if it is not registered."""
    st = state()
    if ps_id not in st.psets.ranks:
        raise ValueError(f"process set {ps_id} is not registered on rank {st.rank}; call "
                         f"hvd.add_process_set() on every rank first")
    return list(st.psets.ranks[ps_id])


def setting(name: str) -> Any:
    """The value of setting ``name`` (a Config field) in the running job."""
    return getattr(state().config, name)
