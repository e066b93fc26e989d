"""Horovod's public reductions for TensorFlow (compression, sparse tensors) and the gradient reduction helper."""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import tensorflow as tf

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core import Adasum, Average, ReduceOp, Sum, rank
from hvdlite.core.frontend import (accumulation_of, check_gradient_options, check_sparse, check_sparse_compression,
                                   gradient_scales, resolve_op)

from .compression import Compression, Compressor
from .errors import as_list, as_tensor, as_tensors
from .mpi_ops import _grouped_allreduce, _grouped_reducescatter, dense, grouped_allgather


def _sparse_allreduce(slices: list[tf.IndexedSlices], op: ReduceOp,
                      process_set: ProcessSet, name: Optional[str] = None) -> list[tf.IndexedSlices]:
    """Reduce sparse tensors as Horovod does: one grouped allgather of every rank's (indices, values), then for
    Average TensorFlow's ``/`` by the set's size (integer values become floats)."""
    check_sparse(op, name)
    k = len(slices)
    gathered = grouped_allgather([s.values for s in slices] + [s.indices for s in slices], name=name,
                                 process_set=process_set)
    pairs = list(zip(gathered[:k], gathered[k:]))
    if op is Average:
        pairs = [(values / tf.cast(process_set.size(), values.dtype), indices) for values, indices in pairs]
    return [tf.IndexedSlices(values, indices, dense_shape=s.dense_shape) for s, (values, indices) in zip(slices, pairs)]


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None, device_dense: str = "",
                      device_sparse: str = "", compression: type = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: Optional[str] = None) -> list[Any]:
    """Reduce a list of tf.Tensor / tf.IndexedSlices as one unit; default op is Average."""
    tensors = [t if isinstance(t, tf.IndexedSlices) else as_tensor(t, "grouped_allreduce")
               for t in as_list(tensors, "grouped_allreduce")]
    if not tensors:
        return tensors
    reduce_op = resolve_op(op, average)
    result: list[Any] = [None] * len(tensors)
    sparse_at = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse_at:
        check_sparse(reduce_op, name, prescale_factor, postscale_factor)
        check_sparse_compression(compression, f"tensor {sparse_at[0]} of allreduce {name!r}", rank())
        for i, s in zip(sparse_at, _sparse_allreduce([tensors[i] for i in sparse_at], reduce_op, process_set)):
            result[i] = s
    if dense_at:
        compressed, ctxs = zip(*[compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense_at])
        reduced = _grouped_allreduce(list(compressed), name=name, op=reduce_op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, process_set=process_set,
                                     accumulation=accumulation_of(compression))
        for i, r, ctx in zip(dense_at, reduced, ctxs):
            result[i] = compression.decompress(r, ctx)
    return result


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "", device_sparse: str = "",
              compression: type = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce a tf.Tensor, tf.Variable or tf.IndexedSlices (Sum or Average only) over all ranks; default Average."""
    tensor = tensor if isinstance(tensor, tf.IndexedSlices) else as_tensor(tensor, "allreduce")
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op, prescale_factor,
                             postscale_factor, process_set, ignore_name_scope, name)[0]


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: type = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """Reduce each tensor and give each rank its share of the first dimension; default op is Average."""
    tensors = as_tensors(tensors, "grouped_reducescatter")
    if not tensors:
        return tensors
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = _grouped_reducescatter(list(compressed), op=op, process_set=process_set,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return [compression.decompress(r, ctx) for r, ctx in zip(reduced, ctxs)]


def reducescatter(tensor: Any, device_dense: str = "", compression: type = Compression.none, op: Any = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` and keep this rank's share of its first dimension; default op is Average."""
    compressed, ctx = compression.compress(as_tensor(tensor, "reducescatter"))
    reduced = _grouped_reducescatter([compressed], name=name, op=op, process_set=process_set,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor)[0]
    return compression.decompress(reduced, ctx)


def gradient_settings(op: Any, gradient_predivide_factor: float, groups: Any, compression: type,
                      sparse_as_dense: bool, process_set: ProcessSet, scale_local_gradients: bool,
                      backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                      optimizer: bool = True) -> dict:
    """A DistributedOptimizer's (``optimizer=False``: DistributedGradientTape's) settings, checked as Horovod's."""
    reduce_op, passes = check_gradient_options(op, gradient_predivide_factor, backward_passes_per_step)
    if optimizer and reduce_op not in (Average, Sum, Adasum):
        raise ValueError(f"op currently only supports hvd.Average, hvd.Sum and hvd.Adasum, got {reduce_op!r}")
    if groups is not None and not (isinstance(groups, list) or int(groups) > 0):
        raise ValueError("groups must be a positive integer or a list of lists of variables")
    return dict(compression=compression, sparse_as_dense=bool(sparse_as_dense), op=reduce_op,
                gradient_predivide_factor=float(gradient_predivide_factor), backward_passes_per_step=passes,
                average_aggregated_gradients=bool(average_aggregated_gradients), process_set=process_set,
                scale_local_gradients=bool(scale_local_gradients))


def reduce_gradients(grads: Sequence[Any], compression: type = Compression.none, sparse_as_dense: bool = False,
                     op: Any = Average, gradient_predivide_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set,
                     names: Optional[Sequence[str]] = None) -> list[Any]:
    """Reduce a list of gradients (None entries stay None) in one fused dense op and one sparse op, named from
    ``names`` (one per gradient) the same at every step, so the response cache hits."""
    reduce_op = resolve_op(op)
    grads = [dense(g) if sparse_as_dense and g is not None else g for g in grads]
    if not process_set.included() or process_set.size() == 1:
        return grads  # nothing to combine (Horovod skips the collective the same way)
    prescale, postscale = gradient_scales(reduce_op, gradient_predivide_factor)
    sparse_at = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    dense_at = [i for i, g in enumerate(grads) if g is not None and i not in sparse_at]
    reduced = grouped_allreduce([grads[i] for i in dense_at], compression=compression,
                                op=reduce_op, prescale_factor=prescale, postscale_factor=postscale,
                                process_set=process_set, name=_group_name("grads", names, dense_at))
    out = list(grads)
    for i, r in zip(dense_at, reduced):
        out[i] = r
    if sparse_at:
        check_sparse_compression(compression, f"the gradient of {names[sparse_at[0]] if names else sparse_at[0]!r}",
                                 rank())
        for i, s in zip(sparse_at, _sparse_allreduce([grads[i] for i in sparse_at], reduce_op, process_set,
                                                     _group_name("sparse_grads", names, sparse_at))):
            out[i] = s
    return out


def _group_name(kind: str, names: Optional[Sequence[str]], picked: Sequence[int]) -> Optional[str]:
    """A name for one grouped reduction of these gradients: stable across steps, short, and unique to the set
    of variables (two models' gradients get different names)."""
    if names is None or not picked:
        return None
    joined = "\n".join(str(names[i]) for i in picked)
    return f"{kind}.{len(picked)}.{hashlib.sha1(joined.encode()).hexdigest()[:16]}"


__all__ = ["gradient_settings", "allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter",
           "reduce_gradients", "Compressor"]
