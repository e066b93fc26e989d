"""Inside tf.function, collective errors are the tf.errors types Horovod raises: mismatches across ranks are
FailedPreconditionError (through the HvdliteCheckStatus op), bad arguments InvalidArgumentError; the engine
keeps working afterwards; without the op, the documented fallback (PyFunc's own mapping)."""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pytest
import tensorflow as tf

import hvdlite.tensorflow as hvd
from hvdlite.tensorflow import status_op

MPI_SIZES = (2, 3)


@pytest.fixture(autouse=True)
def _no_leftover_errors() -> Iterator[None]:
    yield
    assert status_op._errors == {}, "an error stored for HvdliteCheckStatus was never consumed"


def _graph_ops(fn: tf.types.experimental.GenericFunction, *args: tf.Tensor) -> list[str]:
    return [op.type for op in fn.get_concrete_function(*args).graph.get_operations()]


def _still_works(size: int) -> None:
    """A collective in a fresh tf.function after an error: the engine is alive and in step on every rank."""
    @tf.function
    def ok(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="graph_errors.ok")
    np.testing.assert_array_equal(ok(tf.ones([3])).numpy(), [size] * 3)


def _raises_in_graph(fn: Callable[[], tf.Tensor], error: type, pattern: str) -> tf.errors.OpError:
    with pytest.raises(error, match=pattern) as info:
        fn()
    assert type(info.value) is error, type(info.value)  # the exact class TensorFlow raises, not a subclass
    return info.value


def test_op_is_registered_and_in_the_graph(size: int) -> None:
    assert status_op.available(), status_op._state.get("why")

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="graph_errors.registered")
    assert status_op.OP_NAME in _graph_ops(step, tf.ones([2, 3]))
    np.testing.assert_array_equal(step(tf.ones([2, 3])).numpy(), np.full((2, 3), size))


def test_clearing_the_kernel_cache_runs_no_python(size: int) -> None:
    """TensorFlow destroys the op's kernels (tf.random.set_seed, Keras's clear_session: on the calling thread)
    while it holds the eager context's lock; a Python callback there waits for the GIL, which another thread
    waiting for that lock may hold: CI's np3 job once hung that way (a tf.function's finalizer on the engine
    thread). The kernel has no Python create or delete callback, so no Python runs while the cache is cleared."""
    import sys

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="graph_errors.cleared")
    assert status_op.OP_NAME in _graph_ops(step, tf.ones([2])), status_op._state.get("why")
    np.testing.assert_array_equal(step(tf.ones([2])).numpy(), [size] * 2)  # its kernels are cached now
    ran: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        code = frame.f_code  # the kernel's callbacks, as written or as AutoGraph converted them
        if event == "call" and (code.co_filename == status_op.__file__ or code.co_name in ("create", "delete")):
            ran.append(f"{code.co_filename}:{code.co_name}")
    sys.setprofile(profile)
    try:
        tf.random.set_seed(5)  # clears every cached kernel (the op's included) on this thread
    finally:
        sys.setprofile(None)
    assert ran == [], f"the op's Python callbacks ran while TensorFlow cleared its kernel cache: {ran}"
    np.testing.assert_array_equal(step(tf.ones([2])).numpy(), [size] * 2)  # kernels made again, still right


def test_gate_passes_values_and_static_shapes_through() -> None:
    @tf.function
    def check(x: tf.Tensor, y: tf.Tensor) -> list:
        outs = status_op.gate(tf.constant(0, tf.int64), [x, y], name="gate")
        assert outs[0].shape.as_list() == [2, None] and outs[1].shape.as_list() == [], [o.shape for o in outs]
        return outs
    check.get_concrete_function(tf.TensorSpec([2, None], tf.float32), tf.TensorSpec([], tf.int32))
    outs = check(tf.ones([2, 5]), tf.constant(7))
    np.testing.assert_array_equal(outs[0].numpy(), np.ones([2, 5]))
    assert outs[1].numpy() == 7 and outs[1].dtype == tf.int32


def test_shape_mismatch_is_failed_precondition_naming_tensor_and_ranks(rank: int, size: int) -> None:
    last = size - 1

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="graph_errors.shape")
    others = "rank 0" if size == 2 else "ranks 0, 1"
    err = _raises_in_graph(lambda: step(tf.ones([4 if rank == last else 3])), tf.errors.FailedPreconditionError,
                           rf"Mismatched allreduce for tensor 'graph_errors.shape': the shape differs across "
                           rf"ranks \({others}: \(3,\); rank {last}: \(4,\)\)")
    assert "give different tensors different names" in err.message
    _still_works(size)


def test_dtype_op_and_root_mismatches_are_failed_precondition(rank: int, size: int) -> None:
    last = size - 1

    @tf.function
    def dtype_step() -> tf.Tensor:
        return hvd.allreduce(tf.ones([3], tf.float64 if rank == last else tf.float32), name="graph_errors.dtype")

    @tf.function
    def op_step() -> tf.Tensor:
        return hvd.allreduce(tf.ones([3]), op=hvd.Max if rank == last else hvd.Sum, name="graph_errors.op")

    @tf.function
    def root_step(x: tf.Tensor) -> tf.Tensor:
        return hvd.broadcast(x, 1 if rank == last else 0, name="graph_errors.root")

    for what, call in (("dtype", dtype_step), ("op", op_step), ("root", lambda: root_step(tf.ones([3])))):
        _raises_in_graph(call, tf.errors.FailedPreconditionError,
                         rf"Mismatched \w+ for tensor 'graph_errors.{what}'.*differs across ranks")
        _still_works(size)


def test_grouped_and_gradient_mismatch_in_a_training_step(rank: int, size: int) -> None:
    w = tf.Variable(tf.ones([3 if rank == 0 else 2]), name="graph_errors_w")

    @tf.function
    def train_step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, [w])[0]
    _raises_in_graph(train_step, tf.errors.FailedPreconditionError, r"shape differs across ranks")
    _still_works(size)


def test_argument_errors_are_invalid_argument(size: int) -> None:
    @tf.function
    def bad_root(x: tf.Tensor) -> tf.Tensor:
        return hvd.broadcast(x, size, name="graph_errors.bad_root")

    @tf.function
    def bad_alltoall(x: tf.Tensor) -> tf.Tensor:
        return hvd.alltoall(x, name="graph_errors.bad_alltoall")

    _raises_in_graph(lambda: bad_root(tf.ones([2])), tf.errors.InvalidArgumentError,
                     rf"broadcast of 'graph_errors.bad_root': root_rank is not a member of the process set "
                     rf"\(ranks .*: {size}\)")
    _still_works(size)
    _raises_in_graph(lambda: bad_alltoall(tf.ones([2 * size + 1])), tf.errors.InvalidArgumentError,
                     rf"alltoall 'graph_errors.bad_alltoall': the first dimension \({2 * size + 1}\) is not "
                     rf"divisible")
    _still_works(size)


def test_a_failed_collective_stops_the_ones_after_it(rank: int, size: int) -> None:
    """The second collective of the step depends on the first one's check: no rank runs it after a failure
    (which would leave it waiting for ranks that stopped), and the same names work in the next step."""
    last = size - 1

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        y = hvd.allreduce(x, op=hvd.Sum, name="graph_errors.first")
        return hvd.allreduce(y, op=hvd.Sum, name="graph_errors.second")
    _raises_in_graph(lambda: step(tf.ones([4 if rank == last else 3])), tf.errors.FailedPreconditionError,
                     "graph_errors.first")
    np.testing.assert_array_equal(step(tf.ones([3])).numpy(), [size * size] * 3)


def test_fallback_without_the_op_keeps_pyfunc_errors(rank: int, size: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C API is unavailable, graph mode still raises (no crash) with hvdlite's message, as PyFunc
    maps it: InvalidArgumentError for a mismatch (hvd.TensorMismatchError is a ValueError) and a bad argument."""
    def unavailable() -> None:
        raise AttributeError("undefined symbol: TF_NewKernelBuilder")
    monkeypatch.setattr(status_op, "_state", {})
    monkeypatch.setattr(status_op, "_register", unavailable)
    assert not status_op.available()
    assert "TF_NewKernelBuilder" in str(status_op._state["why"])
    last = size - 1

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="graph_errors.fallback")
    assert status_op.OP_NAME not in _graph_ops(step, tf.TensorSpec([None], tf.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="shape differs across ranks"):
        step(tf.ones([4 if rank == last else 3]))

    @tf.function
    def bad_root(x: tf.Tensor) -> tf.Tensor:
        return hvd.broadcast(x, size, name="graph_errors.fallback_root")
    with pytest.raises(tf.errors.InvalidArgumentError, match="root_rank is not a member of the process set"):
        bad_root(tf.ones([2]))
    _still_works(size)
