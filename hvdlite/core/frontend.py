"""The documented interface between the core and the framework frontends: what they may use beyond the
public API (``hvdlite.core``'s exports, ``hvdlite.core.elastic`` and ``hvdlite.core.basics``).

Policy both frontends need is written once here or in the module it comes from (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import numpy as np

from .compression import (CastCompressor, Compressor, NoneCompressor, accumulating, accumulation_of,
                          check_sparse_compression)
from .basics import register_gpu_probe
from .config import Config
from .replicas import check_named as check_named_replicas
from .replicas import flatten as flatten_tensors
from .engine.fusion import aligned_empty
from .log import logger
from .engine.mpi import cuda_aware as mpi_cuda_aware
from .engine.planes import (Bootstrap, DataPlane, PlaneBuffer, PlaneFactory, accumulated_allreduce, in_rank_order,
                            rank_order_allreduce, register_factory)
from .reduce_ops import SUPPORTED_DTYPES, Accumulation, ReduceOp, check_reduction, exact_divisor, resolve_op
from .engine.handles import UNSET, Handle
from .engine.requests import Kind, tensor_layout
from .process_sets import ProcessSet
from .runtime import core_sharing, generation, is_initialized, state
from .submission import layout_of, submit
from .api import check_process_set, check_sparse, sparse_allgather_async

__all__ = ["resolve_op", "check_reduction", "check_gradient_options", "gradient_scales", "mixin_class",
           "Compressor", "NoneCompressor", "CastCompressor", "Accumulation", "accumulating", "accumulation_of",
           "check_sparse_compression", "gradient_overlap",
           "process_set_ranks", "setting", "logger",
           "check_sparse", "sparse_allgather_async", "sync_moments", "aligned_empty",
           "PlaneBuffer", "DataPlane", "PlaneFactory", "Bootstrap", "register_factory", "plane_agreed",
           "plane_lacking", "mpi_cuda_aware", "in_rank_order", "rank_order_allreduce", "accumulated_allreduce",
           "check_named_replicas", "flatten_tensors", "submit_allreduce", "tensor_layout",
           "generation", "exact_divisor", "SUPPORTED_DTYPES", "register_gpu_probe", "check_process_set"]


def check_gradient_options(op: Any, gradient_predivide_factor: float = 1.0,
                           backward_passes_per_step: int = 1) -> tuple[ReduceOp, int]:
    """A distributed optimizer's or tape's reduce op and backward passes per step, checked by Horovod's rules."""
    reduce_op = resolve_op(op)
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is only supported with "
                         f"op=hvd.Average, got {reduce_op!r}; pass gradient_predivide_factor=1.0 or op=hvd.Average")
    passes = int(backward_passes_per_step)
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    return reduce_op, passes


class Scales(NamedTuple):
    """The factors a gradient reduction applies before (``prescale``) and after (``postscale``) it."""
    prescale: float
    postscale: float


def gradient_scales(op: Any, gradient_predivide_factor: float = 1.0) -> Scales:
    """The scales of a distributed optimizer's or tape's gradient reductions: with hvd.Average, Horovod's
    ``gradient_predivide_factor`` divides by the factor before the sum and by ``size / factor`` after it."""
    factor = float(gradient_predivide_factor)
    if resolve_op(op) is ReduceOp.AVERAGE and factor != 1.0:
        return Scales(1.0 / factor, factor)
    return Scales(1.0, 1.0)


_mixed: dict[tuple[type, type], type] = {}
_mixed_lock = threading.Lock()


def mixin_class(mixin: type, base: type, **attributes: Any) -> type:
    """A subclass of the user's class ``base`` with ``mixin``'s methods in front, named and documented like
    ``base``, its ``_hvd_base``; built once per pair, or each call with extra class ``attributes``."""
    def build() -> type:
        namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
                     "_hvd_base": base, **attributes}
        return type(base.__name__, (mixin, base), namespace)
    if attributes:
        return build()
    with _mixed_lock:
        cls = _mixed.get((mixin, base))
        if cls is None:
            cls = _mixed[(mixin, base)] = build()
        return cls


def local_overlap_verdict(compute_threads: Optional[int]) -> bool:
    """This rank's own view: "auto" overlaps when every rank on the node has a core for its engine besides its
    ``compute_threads`` (None: backward runs on an accelerator)."""
    current = state()
    setting = current.config.gradient_overlap
    if setting != "auto":
        return setting == "on"
    if compute_threads is None:
        return True
    sharing, mine = core_sharing(current.local_size)
    return mine >= sharing * (compute_threads + 1)


def gradient_overlap(compute_threads: Optional[int], process_set: Optional[ProcessSet] = None) -> bool:
    """Whether a frontend starts gradient reductions during backward: every member calls this, and the set
    overlaps only if every member's view says so (so all issue the same collectives)."""
    current = state()
    verdict = local_overlap_verdict(compute_threads)
    if current.config.gradient_overlap != "auto":
        return verdict  # the setting itself is agreed at init()
    ps = process_set if process_set is not None else current.psets.sets[0]
    ps_id = ps.process_set_id or 0
    name = current.names.name("gradient_overlap.agreement", None, ps_id)
    vote = (np.array([int(verdict)], dtype=np.int32),)
    handle = submit(current, Kind.ALLREDUCE, name, ps_id, vote, ("int32",), layout_of(vote, ("int32",)), (None,),
                    op=ReduceOp.MIN, generated=True)
    return bool(handle.wait()[0][0])


def process_set_ranks(ps_id: int) -> list[int]:
    """Members (global ranks) of the registered process set ``ps_id``; ValueError if it is not registered."""
    return list(state().psets.ranks[check_process_set(ps_id, "the size or rank of a process set")])


def setting(name: str) -> Any:
    """The value of setting ``name`` (a Config field; a former name warns) in the running job."""
    return getattr(state().config, Config.field_for(name))


def plane_agreed(name: str) -> bool:
    """Whether every rank of the running job has data plane ``name`` (False before init())."""
    return is_initialized() and state().planes.has(name)


def plane_lacking(name: str) -> list[int]:
    """The ranks of the running job that cannot run data plane ``name`` ([] where it is agreed or before init())."""
    return state().planes.lacking(name) if is_initialized() else []


def submit_allreduce(name: Optional[str], inputs: tuple[Any, ...], dtypes: tuple[str, ...], layout: tuple[Any, ...],
                     outputs: tuple[Any, ...], op: ReduceOp, prescale: float, postscale: float, value: Any = UNSET,
                     held: Any = None) -> Handle:
    """An allreduce on the global set of arrays a frontend prepared (see submission.submit; ``layout`` from
    tensor_layout, ``outputs`` the inputs for in place) whose handle returns ``value`` and keeps ``held``."""
    return submit(state(), Kind.ALLREDUCE, name, 0, inputs, dtypes, layout, outputs, op, prescale, postscale, 0, None,
                  value, held)


#: A framework's tensor type (arithmetic on it is the framework's own; the checker sees Any).
T = TypeVar("T", bound=Any)


def sync_moments(x: T, weights: Optional[T], sum_over: Callable[[T], T],
                 grouped_allreduce_sum: Callable[[list[Any]], list[Any]], expand: Callable[[T], T]) -> tuple[T, T, T]:
    """SyncBatchNorm's (mean, biased variance, element count) per channel over a process set, in two passes (the
    global mean, then the mean of squared deviations from it): ``sum_over`` sums the batch (and spatial) axes,
    ``expand`` broadcasts per-channel values against ``x``, ``grouped_allreduce_sum`` sums a list of tensors
    across the set (differentiably); ``weights`` (a mask, or None) weights each element."""
    weighted = x if weights is None else x * weights
    count = sum_over(x ** 0) if weights is None else sum_over(weights)  # x ** 0 is 1 even for inf and nan
    total, n = grouped_allreduce_sum([sum_over(weighted), count])
    mean = total / n
    centred = x - expand(mean)
    squares = centred * centred if weights is None else centred * centred * weights
    (var_sum,) = grouped_allreduce_sum([sum_over(squares)])
    return mean, var_sum / n, n
