"""TensorFlow ops over the hvdlite core: each collective is a numpy call, eager or in tf.function, with a gradient;
and the topology ops (``hvd.rank_op()``, ``size_op()``, ...), int32 scalars read when the graph runs.

In a graph each collective is a stateful ``tf.numpy_function`` with a control dependency on the one created before
it, so all ranks run them in traced order (and never block several executor threads at once).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from hvdlite import core
from hvdlite.core import Average, HvdliteError, ProcessSet, Sum, TensorMismatchError, global_process_set
from hvdlite.core.basics import _basics  # noqa: F401 - Horovod's hvd.mpi_ops._basics
from hvdlite.core.frontend import Accumulation, check_process_set, process_set_ranks, register_gpu_probe, resolve_op
from hvdlite.tensorflow import status_op
from hvdlite.tensorflow.buffers import ReusableOutputs
from hvdlite.tensorflow.errors import as_list, as_tensor, as_tensors, as_tf_error


class XLANotSupportedError(HvdliteError, NotImplementedError):
    """A collective was built inside XLA-compiled code, which cannot call back into Python."""

    __init__ = Exception.__init__  # lets tf.function's AutoGraph re-raise it as this type, not StagingError


register_gpu_probe("tensorflow", lambda: bool(tf.config.list_physical_devices("GPU")))

_last_collective: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _in_xla_context() -> bool:
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    return graph is not None and bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def check_not_xla(what: str) -> None:
    """Raise a clear error when ``what`` is being traced for XLA (jit_compile=True)."""
    if _in_xla_context():
        raise XLANotSupportedError(
            f"hvdlite.tensorflow {what} cannot run inside XLA-compiled code (tf.function(jit_compile=True) or "
            f"model.compile(jit_compile=True)): hvdlite's collectives call into Python, which XLA cannot do. "
            f"Fix: compile that function with jit_compile=False (for Keras: model.compile(..., "
            f"jit_compile=False)); you may keep XLA for a separate function that only computes the gradients.")


def _fix_dtype(array: Any, dtype: np.dtype) -> np.ndarray:
    """The core may hand bfloat16 back as uint16 bits: view it as the dtype TensorFlow expects."""
    a = np.asarray(array)
    if a.dtype == dtype:
        return a
    if a.dtype.itemsize == dtype.itemsize and "bfloat16" in (a.dtype.name, dtype.name):
        return a.view(dtype)
    return a.astype(dtype)


def run_collective(kind: str, fn: Callable[..., Sequence[Any]], inputs: Sequence[tf.Tensor],
                   out_dtypes: Sequence[tf.DType]) -> list[tf.Tensor]:
    """Run ``fn(*numpy inputs) -> numpy outputs`` as one op: eagerly now, or as a node of the current graph."""
    check_not_xla(kind)
    np_types = [np.dtype(d.as_numpy_dtype) for d in out_dtypes]

    def body(*arrays: np.ndarray) -> list[np.ndarray]:
        return [_fix_dtype(out, d) for out, d in zip(fn(*arrays), np_types)]

    if tf.executing_eagerly():
        try:
            outs = body(*[np.asarray(t) for t in inputs])  # read-only views (.numpy() copies)
        except (TensorMismatchError, ValueError, TypeError) as exc:
            converted = as_tf_error(exc)
            if converted is exc:
                raise
            raise converted from exc
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, out_dtypes)]
    graph = tf.compat.v1.get_default_graph()
    previous = _last_collective.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        # ends in an HvdliteCheckStatus op when it can: later collectives never start after a failed one
        outs = status_op.numpy_function(body, list(inputs), list(out_dtypes),
                                        name="Hvdlite" + kind.title().replace("_", ""))
    if outs:
        _last_collective[graph] = outs[0].op
    return outs


@contextlib.contextmanager
def unchained_collectives() -> Iterator[None]:
    """Collectives built inside neither wait for the graph's earlier collectives nor make its later ones wait
    for them: for an op a ``tf.compat.v1`` session runs on its own (the broadcast of the initial variables),
    which must not pull in a training step's collectives (and their placeholders), nor be re-run by them."""
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    previous = _last_collective.pop(graph, None)
    try:
        yield
    finally:
        _last_collective.pop(graph, None)
        if previous is not None:
            _last_collective[graph] = previous


def _set_shape(t: tf.Tensor, shape: Any) -> tf.Tensor:
    if not tf.executing_eagerly():
        t.set_shape(shape)
    return t


def _rows_shape(x: tf.Tensor) -> tf.TensorShape:
    """Static shape of a result whose first dimension depends on other ranks."""
    if x.shape.rank is None:
        return tf.TensorShape(None)
    if x.shape.rank == 0:
        return tf.TensorShape([None])
    return tf.TensorShape([None]).concatenate(x.shape[1:])


def dense(t: Any) -> Any:
    """Turn a tf.IndexedSlices (a sparse gradient) into a dense tensor; pass anything else through."""
    return tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t


def _grouped_op(kind: str, fn: Callable[..., Sequence[Any]], xs: Sequence[tf.Tensor],
                shape_of: Callable[[tf.Tensor], Any],
                grad: Callable[[list[tf.Tensor], list[tf.Tensor]], list[tf.Tensor]]) -> list[tf.Tensor]:
    """``fn`` over ``xs`` (if any) as one op with a gradient, ``grad(inputs, upstream gradients)``: missing upstream
    gradients come as zeros, sparse ones dense. Each output's static shape is ``shape_of(its input)``."""
    if not xs:
        return []

    @tf.custom_gradient
    def forward(*inputs: tf.Tensor) -> Any:
        ys = run_collective(kind, fn, inputs, [x.dtype for x in inputs])
        ys = [_set_shape(y, shape_of(x)) for y, x in zip(ys, inputs)]

        def backward(*dys: Any) -> list[tf.Tensor]:
            return grad(list(inputs), [tf.zeros_like(y) if dy is None else dense(dy) for dy, y in zip(dys, ys)])
        return ys, backward

    return list(forward(*xs))


# -- allreduce --------------------------------------------------------------------------------------
def _grouped_allreduce(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Sum,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       accumulation: Optional[Accumulation] = None) -> list[tf.Tensor]:
    """Reduce several dense tensors as one unit (one op, one fused request); ``accumulation``: an
    accumulating compression's (bf16/fp16 on the wire, float32 sums)."""
    check_process_set(process_set, "allreduce")
    reduce_op = resolve_op(op)
    xs = [tf.convert_to_tensor(dense(t)) for t in tensors]

    # a graph op runs at every step: it reduces into warm, aligned buffers (TensorFlow wraps them without a copy)
    outputs = None if tf.executing_eagerly() else ReusableOutputs()

    def reduce(*arrays: np.ndarray) -> list[np.ndarray]:
        return core.grouped_allreduce(
            list(arrays), name=name, op=reduce_op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=process_set, outputs=None if outputs is None else outputs.like(arrays),
            accumulation=accumulation)

    return _grouped_op("allreduce", reduce, xs, lambda x: x.shape, lambda _, dys: _grouped_allreduce(
        dys, op=reduce_op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set, accumulation=accumulation))


# -- allgather --------------------------------------------------------------------------------------
def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate ``tensor`` from every rank along the first dimension (which may differ per rank)."""
    return grouped_allgather([as_tensor(tensor, "allgather")], name, ignore_name_scope, process_set)[0]


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather several tensors as one unit."""
    check_process_set(process_set, "allgather")
    xs = as_tensors(tensors, "grouped_allgather")

    def gather(*arrays: np.ndarray) -> list[np.ndarray]:
        return core.grouped_allgather(list(arrays), name=name, process_set=process_set)

    def grad(inputs: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        # Horovod's convention: the upstream gradients averaged over ranks, then this rank's rows of them
        reduced = _grouped_allreduce(dys, op=Average, process_set=process_set)
        firsts = tf.stack([tf.constant(1, tf.int64) if x.shape.rank == 0 else tf.shape(x, out_type=tf.int64)[0]
                           for x in inputs])
        sizes = tf.reshape(allgather(firsts, process_set=process_set), [process_set.size(), len(inputs)])
        me = process_set.rank()
        grads = []
        for i, (x, g) in enumerate(zip(inputs, reduced)):
            start = tf.reduce_sum(sizes[:me, i])
            grads.append(tf.reshape(g[start:start + sizes[me, i]], tf.shape(x)))
        return grads

    return _grouped_op("allgather", gather, xs, _rows_shape, grad)


# -- broadcast --------------------------------------------------------------------------------------
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Copy ``tensor`` from ``root_rank`` (a rank of the whole job, as in Horovod) to every member."""
    root = int(root_rank)

    @tf.custom_gradient
    def forward(x: tf.Tensor) -> Any:
        y = broadcast_group([x], root, name, process_set, "broadcast")[0]

        def grad(dy: Any) -> tf.Tensor:
            # Horovod's gradient: the average, kept on the root, zero elsewhere; the zeros depend on the allreduce,
            # so that a tf.compat.v1 session runs it on every rank (zeros of a known shape would not)
            reduced = _grouped_allreduce([dense(dy)], op=Average, process_set=process_set)[0]
            if core.rank() == root:
                return reduced
            with tf.control_dependencies([reduced]):
                return tf.zeros_like(reduced)
        return y, grad

    return forward(as_tensor(tensor, "broadcast"))


def broadcast_group(tensors: Sequence[Any], root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set, what: str = "broadcast_group") -> list[tf.Tensor]:
    """Broadcast several tensors in one op (no gradient): the values of ``root_rank``."""
    check_process_set(process_set, what)
    xs = as_tensors(tensors, what)
    if not xs:
        return []
    root = int(root_rank)

    def bcast(*arrays: np.ndarray) -> list[np.ndarray]:
        handles = [core.broadcast_async(a, root, name=f"{name}.{i}" if name is not None and len(arrays) > 1 else name,
                                        process_set=process_set) for i, a in enumerate(arrays)]
        return [h.wait() for h in handles]

    outs = run_collective("broadcast", bcast, xs, [x.dtype for x in xs])
    return [_set_shape(y, x.shape) for y, x in zip(outs, xs)]


def broadcast_(variables: Sequence[Any], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Overwrite each variable with its value on ``root_rank``; returns the new values (in a graph, the variables
    read after their assignment, as Horovod's in-place op returns the variables)."""
    variables = as_list(variables, "broadcast_")
    values = broadcast_group(variables, root_rank, name, process_set, "broadcast_")
    assigned = [v.assign(val) for v, val in zip(variables, values)]
    if tf.executing_eagerly():
        return values
    return [val if a is None else tf.convert_to_tensor(a) for a, val in zip(assigned, values)]


# -- alltoall ---------------------------------------------------------------------------------------
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows to rank i; returns the received rows, plus the received splits if given."""
    check_process_set(process_set, "alltoall")
    given = splits is not None
    split_t = tf.cast(tf.convert_to_tensor(splits), tf.int32) if given else tf.zeros([0], tf.int32)

    def exchange(array: np.ndarray, sp: np.ndarray) -> list[np.ndarray]:
        out, received = core.alltoall(array, splits=sp if given else None, name=name, process_set=process_set)
        return [out, np.asarray(received, dtype=np.int32).reshape(-1)]

    @tf.custom_gradient
    def forward(x: tf.Tensor, sp: tf.Tensor) -> Any:
        y, received = run_collective("alltoall", exchange, [x, sp], [x.dtype, tf.int32])
        y = _set_shape(y, _rows_shape(x))
        received = _set_shape(received, [process_set.size()])

        def grad(dy: Any, _d_received: Any) -> Any:
            back, _ = alltoall(dense(dy), splits=received, process_set=process_set)
            return back, None
        return (y, received), grad

    out, received = forward(as_tensor(tensor, "alltoall"), split_t)
    return (out, received) if given else out


# -- reducescatter ----------------------------------------------------------------------------------
def _grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None, op: Any = Sum,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """Reduce, then keep this rank's share of the first dimension (earlier ranks take the remainder)."""
    check_process_set(process_set, "reducescatter")
    reduce_op = resolve_op(op)
    xs = [tf.convert_to_tensor(dense(t)) for t in tensors]

    def scatter(*arrays: np.ndarray) -> list[np.ndarray]:
        return core.grouped_reducescatter(list(arrays), name=name, op=reduce_op, process_set=process_set,
                                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    def grad(_: list[tf.Tensor], dys: list[tf.Tensor]) -> list[tf.Tensor]:
        # Horovod's convention: Sum's gradient is multiplied by the set size; the scale factors
        # apply as the chain rule says (the same rule as hvdlite.torch)
        factor = float(prescale_factor) * float(postscale_factor)
        if reduce_op is Sum:
            factor *= process_set.size()
        if factor != 1.0:
            dys = [dy * tf.cast(factor, dy.dtype) for dy in dys]
        return grouped_allgather(dys, process_set=process_set)

    return _grouped_op("reducescatter", scatter, xs, _rows_shape, grad)


# -- synchronisation and topology ops ---------------------------------------------------------------
def join() -> tf.Tensor:
    """This rank has no more data; returns (an int32 tensor of) the rank that joined last."""
    return run_collective("join", lambda: [np.int32(core.join())], [], [tf.int32])[0]


def barrier(process_set: ProcessSet = global_process_set) -> Optional[tf.Operation]:
    """Wait until every rank of ``process_set`` reaches this point (in a graph: returns the op)."""
    check_process_set(process_set, "barrier")
    out = run_collective("barrier", lambda: [np.int32(core.barrier(process_set) or 0)], [], [tf.int32])
    return None if tf.executing_eagerly() else out[0].op


def _value_op(value: Callable[[], int], name: Optional[str] = None) -> tf.Tensor:
    """An int32 scalar computed when the graph runs (a constant under XLA or eagerly)."""
    if tf.executing_eagerly() or _in_xla_context():
        return tf.constant(value(), dtype=tf.int32, name=name)
    return _set_shape(tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name), [])


rank_op = functools.partial(_value_op, core.rank)  # rank_op(name=None), as Horovod's
local_rank_op = functools.partial(_value_op, core.local_rank)
local_size_op = functools.partial(_value_op, core.local_size)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return _value_op(lambda: len(process_set_ranks(int(process_set_id))), name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return _value_op(lambda: int(core.rank() in process_set_ranks(int(process_set_id))), name)
