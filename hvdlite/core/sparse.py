"""Sparse gradients (indices, values) combined across ranks by allgather, as Horovod does, for every frontend."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .api import grouped_allgather_async
from .engine.handles import Handle
from .process_sets import ProcessSet, global_process_set
from .reduce_ops import ReduceOp, bf16_to_f32, f32_to_bf16, resolve_op


def check_sparse(op: Any, name: Optional[str], prescale_factor: float = 1.0,
                 postscale_factor: float = 1.0) -> ReduceOp:
    """The op of a sparse (indices, values) reduction: Sum or Average, unscaled; else NotImplementedError."""
    reduce_op = resolve_op(op)
    if reduce_op is ReduceOp.ADASUM:
        raise NotImplementedError(f"sparse allreduce {name!r}: hvd.Adasum does not support sparse tensors; "
                                  f"pass sparse_as_dense=True to reduce them densely")
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):  # Horovod's type for this refusal
        raise NotImplementedError(f"sparse allreduce {name!r}: only hvd.Average and hvd.Sum are defined for "
                                  f"sparse tensors, got {reduce_op!r}; pass sparse_as_dense=True to reduce "
                                  f"them densely")
    if (prescale_factor, postscale_factor) != (1.0, 1.0):
        raise NotImplementedError(f"sparse allreduce {name!r}: prescale_factor/postscale_factor are not "
                                  f"supported for sparse tensors")
    return reduce_op


def sparse_allgather_async(indices: np.ndarray, values: np.ndarray, op: Any, name: Optional[str] = None,
                           process_set: ProcessSet = global_process_set,
                           values_dtype_hint: Optional[str] = None) -> Handle:
    """Gather every rank's sparse rows (duplicates are summed by whoever densifies them), as Horovod does;
    Average divides the values by the set's size. The result is ``(indices, values)``."""
    reduce_op = check_sparse(op, name)
    handle = grouped_allgather_async([indices, values], name, process_set,
                                     dtype_hints=[None, values_dtype_hint])
    if reduce_op is ReduceOp.AVERAGE:
        n = process_set.size()

        def average(result: list[Any]) -> tuple[Any, ...]:
            all_indices, all_values = result
            if values_dtype_hint == "bfloat16":  # uint16 bits: divide the values, not the bits
                return all_indices, f32_to_bf16(bf16_to_f32(all_values) / np.float32(n))
            if all_values.dtype.kind == "f":
                return all_indices, all_values / all_values.dtype.type(n)
            return all_indices, all_values / n  # true division, as Horovod: integer values become floats
        return handle.then(average)
    return handle.then(lambda result: (result[0], result[1]))
