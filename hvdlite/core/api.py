"""The collectives on numpy arrays (sparse ones allgathered, as Horovod does): each submits a named request."""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .engine.handles import Handle
from .engine.requests import Kind
from .engine.planes import PlaneBuffer
from .process_sets import ProcessSet, global_process_set
from .reduce_ops import Accumulation, ReduceOp, bf16_to_f32, dtype_name, f32_to_bf16, resolve_op, storage_dtype
from .runtime import state
from .submission import layout_of, submit


def _auto_name(kind: str, name: Optional[str], process_set: Optional[ProcessSet] = None) -> str:
    """The caller's name, or one generated per kind and process set, in call order (engine/names.py)."""
    if type(name) is str:
        return name
    ps_id = 0 if process_set is None else (process_set.process_set_id or 0)
    return state().names.name(kind, name, ps_id)


class _Call:
    """One call of a collective: its name (``_auto_name``) and the one submit (core/submission.py). As a context
    manager: a call that raises before it submitted consumes no generated name (Names.give_back)."""

    __slots__ = ("kind", "name", "generated", "process_set")

    def __init__(self, kind: Kind, name: Optional[str], process_set: Optional[ProcessSet]) -> None:
        self.kind = kind
        self.process_set = process_set
        self.generated = type(name) is not str
        self.name = _auto_name(kind.label, name, process_set)

    def __enter__(self) -> _Call:
        return self

    def __exit__(self, error: Optional[type], *_: Any) -> None:
        if error is not None and self.generated:
            ps = self.process_set
            state().names.give_back(self.name, 0 if ps is None else (ps.process_set_id or 0))

    def submit(self, ps_id: int, inputs: Sequence[Any], dtypes: Sequence[str], outputs: Optional[Sequence[Any]] = None,
               rows: bool = False, **options: Any) -> Handle:
        """``rows``: the first dimension may differ per rank."""
        return submit(state(), self.kind, self.name, ps_id, inputs, dtypes, layout_of(inputs, dtypes, rows),
                      outputs if outputs is not None else (None,) * len(inputs), generated=self.generated, **options)


def check_process_set(process_set: Any, what: str) -> int:
    """The id of ``process_set`` (a ProcessSet, or an id) registered on this rank, else the one error saying so
    (``what``: the call); also for ops built before they run (TensorFlow graphs)."""
    ps_id = process_set if type(process_set) is int else getattr(process_set, "process_set_id", None)
    if ps_id == 0:
        return 0
    st = state()
    if ps_id is None or ps_id not in st.psets.ranks:
        shown = f"process set {ps_id}" if type(process_set) is int else repr(process_set)
        raise ValueError(f"{what}: {shown} is not registered on rank {st.rank} (ids {sorted(st.psets.ranks)}); pass "
                         f"it to hvd.init(process_sets=[...]) or hvd.add_process_set() on every rank first")
    return int(ps_id)


def _pset_id(process_set: Optional[ProcessSet], kind: str, name: str) -> int:
    ps_id = check_process_set(global_process_set if process_set is None else process_set, f"{kind} {name!r}")
    if ps_id and not (st := state()).psets.is_member(ps_id):
        raise ValueError(f"{kind} {name!r}: rank {st.rank} is not in process set {ps_id} (ranks "
                         f"{st.psets.members(ps_id)}); only its members may call collectives on it")
    return ps_id


def _prepare(array: Any, dtype_hint: Optional[str] = None) -> tuple[Any, str]:
    """A C-contiguous array in its storage dtype (bfloat16 as uint16 bits) and the dtype name; a PlaneBuffer
    passes through."""
    if type(array) is PlaneBuffer:
        return array, array.dtype_name
    a = array if type(array) is np.ndarray else np.asarray(array)
    dtype = dtype_name(a, dtype_hint)
    if dtype == "bfloat16" and a.dtype != np.uint16:
        a = a.view(np.uint16)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a, dtype


def _prepare_all(arrays: Sequence[Any], hints: Optional[Sequence[Optional[str]]],
                 ) -> tuple[tuple[np.ndarray, ...], tuple[str, ...]]:
    """_prepare for each array, as tuples (which the garbage collector stops tracking)."""
    if len(arrays) == 1:
        prepared, dtype = _prepare(arrays[0], hints[0] if hints else None)
        return (prepared,), (dtype,)
    pairs = [_prepare(a, h) for a, h in zip(arrays, hints or (None,) * len(arrays))]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _copy_back(targets: list[np.ndarray], direct: Sequence[Optional[np.ndarray]]) -> Callable[[Any], Any]:
    """wait() returns ``targets`` (the caller's outputs, or the inputs of an in-place op run on copies), each
    result the engine did not write into ``direct`` (the target itself, or its view) copied into its target."""
    def finalize(results: list[np.ndarray]) -> list[np.ndarray]:
        for target, into, result in zip(targets, direct, results):
            if result is not into:
                np.copyto(target, result.reshape(target.shape).view(target.dtype), casting="unsafe")
        return list(targets)
    return finalize


def _into(kind: str, name: str, outputs: Optional[Sequence[Any]], dtype_hints: Optional[Sequence[Optional[str]]],
          dtypes: Sequence[str]) -> tuple[Optional[list[Any]], Any]:
    """Caller-given outputs: the engine writes each result straight into its output where it fits (C-contiguous,
    the result's shape), else it is copied there; wait() returns them."""
    if outputs is None:
        return None, None
    given = [np.asarray(o) for o in outputs]
    prepared = [_prepare(o, h) for o, h in zip(given, dtype_hints or [None] * len(given))]
    if len(given) != len(dtypes) or [p[1] for p in prepared] != list(dtypes) or any(
            g.dtype.itemsize != storage_dtype(d).itemsize for g, d in zip(given, dtypes)):
        raise TypeError(f"{kind} {name!r}: outputs must be one array per input with the input's dtype; got "
                        f"{[p[1] for p in prepared]} for inputs {dtypes}")
    views = [p[0] for p in prepared]
    direct = [v if np.may_share_memory(v, g) else None for v, g in zip(views, given)]  # else a copy
    return direct, _copy_back(given, direct)


def grouped_allreduce_async(arrays: Sequence[Any], average: Optional[bool] = None, name: Optional[str] = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, inplace: bool = False,
                            dtype_hints: Optional[Sequence[Optional[str]]] = None,
                            outputs: Optional[Sequence[Any]] = None,
                            accumulation: Optional[Accumulation] = None) -> Handle:
    """Reduce several arrays as one unit, into ``outputs`` (not overlapping the inputs) if given; with
    ``accumulation`` (Compression.bf16_fp32acc's...) floating-point arrays are summed in float32."""
    with _Call(Kind.ALLREDUCE, name, process_set) as call:
        reduce_op = resolve_op(op, average)
        ps_id = _pset_id(process_set, "allreduce", call.name)
        inputs, dtypes = _prepare_all(arrays, dtype_hints)
        finalize = None  # (the reduction's checks: the one submit's, once per name)
        if outputs is not None and not inplace:
            if len(outputs) != len(inputs) or any(np.shape(o) != a.shape for o, a in zip(outputs, inputs)):
                raise TypeError(f"allreduce {call.name!r}: outputs must be one array per input with the input's shape; "
                                f"got {[np.shape(o) for o in outputs]} for inputs {[a.shape for a in inputs]}")
            outputs, finalize = _into("allreduce", call.name, outputs, dtype_hints, dtypes)
        elif inplace:
            outputs = inputs
            if any(p is not a for p, a in zip(inputs, arrays)):
                originals = [np.asarray(a) for a in arrays]
                if any(p is not o for p, o in zip(inputs, originals)):
                    finalize = _copy_back(originals, originals)
        return call.submit(ps_id, inputs, dtypes, outputs=outputs, op=reduce_op, prescale=prescale_factor,
                           postscale=postscale_factor, finalize=finalize, extra=accumulation)


def allreduce_async(array: Any, average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, inplace: bool = False,
                    dtype_hint: Optional[str] = None) -> Handle:
    """Reduce ``array`` across the ranks of ``process_set``; the result is the reduced array."""
    return grouped_allreduce_async([array], average, name, op, prescale_factor, postscale_factor, process_set,
                                   inplace, [dtype_hint]).first()


def grouped_allgather_async(arrays: Sequence[Any], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set,
                            dtype_hints: Optional[Sequence[Optional[str]]] = None,
                            outputs: Optional[Sequence[Any]] = None) -> Handle:
    """Concatenate each array's rows from every rank (the first dimension may differ per rank); into
    ``outputs`` (one array of the gathered shape per input; an input may be its own rows of it) if given."""
    with _Call(Kind.ALLGATHER, name, process_set) as call:
        ps_id = _pset_id(process_set, "allgather", call.name)
        prepared, dtypes = _prepare_all(arrays, dtype_hints)
        inputs = [a.reshape(1) if a.ndim == 0 else a for a in prepared]
        direct, finalize = _into("allgather", call.name, outputs, dtype_hints, dtypes)
        return call.submit(ps_id, inputs, dtypes, outputs=direct, rows=True, finalize=finalize)


def allgather_async(array: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                    dtype_hint: Optional[str] = None) -> Handle:
    return grouped_allgather_async([array], name, process_set, [dtype_hint]).first()


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


def broadcast_async(array: Any, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set, inplace: bool = False,
                    dtype_hint: Optional[str] = None) -> Handle:
    """Copy ``array`` from ``root_rank`` (a rank of the whole job, as in Horovod) to every member of the set."""
    with _Call(Kind.BROADCAST, name, process_set) as call:
        ps_id = _pset_id(process_set, "broadcast", call.name)
        root = operator.index(root_rank)
        a, dtype = _prepare(array, dtype_hint)
        outputs: list[Optional[np.ndarray]] = [a if inplace else None]
        finalize = None
        if inplace and type(a) is not PlaneBuffer and a is not (original := np.asarray(array)):
            finalize = _copy_back([original], [original])
        return call.submit(ps_id, [a], [dtype], outputs=outputs, root=root, finalize=finalize).first()


def alltoall_async(array: Any, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set, dtype_hint: Optional[str] = None) -> Handle:
    """Send ``splits[i]`` rows to rank i. The result is ``(received array, received splits)``."""
    with _Call(Kind.ALLTOALL, name, process_set) as call:
        ps_id = _pset_id(process_set, "alltoall", call.name)
        a, dtype = _prepare(array, dtype_hint)
        if a.ndim == 0:
            raise ValueError(f"alltoall {call.name!r}: the tensor needs at least one dimension")
        n = state().psets.size(ps_id)
        if splits is None:
            if a.shape[0] % n:
                raise ValueError(f"alltoall {call.name!r}: the first dimension ({a.shape[0]}) is not divisible by the "
                                 f"number of ranks ({n}); pass splits= explicitly")
            split_arr = None
        else:
            split_arr = np.asarray(splits, dtype=np.int64).reshape(-1)
            if split_arr.size != n or (split_arr < 0).any() or split_arr.sum() != a.shape[0]:
                raise ValueError(f"alltoall {call.name!r}: splits {split_arr.tolist()} must have one non-negative "
                                 f"entry per rank ({n}) summing to the first dimension ({a.shape[0]})")
        return call.submit(ps_id, [a], [dtype], splits=split_arr, rows=True)


def grouped_reducescatter_async(arrays: Sequence[Any], name: Optional[str] = None, op: Any = None,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                dtype_hints: Optional[Sequence[Optional[str]]] = None,
                                outputs: Optional[Sequence[Any]] = None) -> Handle:
    """Reduce, then give rank r its share of the first dimension (earlier ranks take the remainder); into
    ``outputs`` (not overlapping the inputs) if given."""
    with _Call(Kind.REDUCESCATTER, name, process_set) as call:
        reduce_op = resolve_op(op)
        ps_id = _pset_id(process_set, "reducescatter", call.name)
        inputs, dtypes = _prepare_all(arrays, dtype_hints)
        if any(a.ndim == 0 for a in inputs):
            raise ValueError(f"reducescatter {call.name!r}: the tensor needs at least one dimension")
        if len(set(dtypes)) > 1:
            raise TypeError(f"reducescatter {call.name!r}: all tensors of a group must share one dtype")
        direct, finalize = _into("reducescatter", call.name, outputs, dtype_hints, dtypes)
        return call.submit(ps_id, inputs, dtypes, op=reduce_op, prescale=prescale_factor,
                           postscale=postscale_factor, outputs=direct, finalize=finalize)


def reducescatter_async(array: Any, name: Optional[str] = None, op: Any = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, dtype_hint: Optional[str] = None) -> Handle:
    return grouped_reducescatter_async([array], name, op, process_set, prescale_factor, postscale_factor,
                                       [dtype_hint]).first()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    call = _Call(Kind.BARRIER, None, process_set)
    call.submit(_pset_id(process_set, "barrier", call.name), [], []).wait()


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank joins, its peers' allreduces get zeros from it. Returns the
    rank that joined last."""
    call = _Call(Kind.JOIN, None, None)
    _pset_id(None, "join", call.name)
    return int(call.submit(0, [], []).wait())


def poll(handle: Handle) -> bool:
    """True when the collective behind ``handle`` has finished (synchronize() will not block)."""
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous collective and return its result (or raise its error)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() takes a handle returned by an *_async function, got "
                        f"{type(handle).__name__}")
    return handle.wait()

