"""Horovod TensorFlow programs run unchanged: the tf.errors types they catch (eagerly), scaling precision,
DistributedGradientTape.gradient's positional order, and gradient reductions with stable names."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import hvdlite.tensorflow as hvd
from hvdlite.core import runtime

MPI_SIZES = (2, 3)


def test_eager_mismatches_are_failed_precondition(rank: int, size: int) -> None:
    last = size - 1
    cases = {
        "shape": lambda: hvd.allreduce(tf.ones([4 if rank == last else 3]), name="tf.shape"),
        "dtype": lambda: hvd.allreduce(tf.ones([3], tf.float64 if rank == last else tf.float32), name="tf.dtype"),
        "op": lambda: hvd.allreduce(tf.ones([3]), op=hvd.Max if rank == last else hvd.Sum, name="tf.op"),
        "root": lambda: hvd.broadcast(tf.ones([3]), 1 if rank == last else 0, name="tf.root"),
    }
    for what, call in cases.items():
        with pytest.raises(tf.errors.FailedPreconditionError, match="differs across ranks") as info:
            call()
        assert isinstance(info.value, hvd.HvdliteError), what
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), [size, size])


def test_argument_errors_are_invalid_argument(size: int) -> None:
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"root_rank is not a member .*: {size}\)"):
        hvd.broadcast(tf.ones([2]), size)
    with pytest.raises(ValueError):  # it is a ValueError too, for programs that catch that
        hvd.broadcast(tf.ones([2]), -1)


def test_graph_mode_argument_error_is_invalid_argument(size: int) -> None:
    @tf.function
    def bad() -> tf.Tensor:
        return hvd.broadcast(tf.ones([2]), size)
    with pytest.raises(tf.errors.InvalidArgumentError, match="root_rank is not a member of the process set"):
        bad()


def test_every_op_given_a_bad_argument_raises_a_type_error_naming_itself() -> None:
    """As a Horovod op's type constraint does, at the call (eagerly, and while tracing: AutoGraph adds where): the
    op the user called, not the one it delegates to, and what it got."""
    ops = {"allreduce": (), "allgather": (), "broadcast": (0,), "alltoall": (), "reducescatter": (),
           "grouped_allreduce": (), "grouped_allgather": (), "grouped_reducescatter": (), "broadcast_": (0,)}
    wrong = []
    for name, args in ops.items():
        grouped = name.startswith("grouped_") or name == "broadcast_"
        cases = [("not a tensor", "expected a tf.Tensor, got str"), (object(), "expected a tf.Tensor, got object"),
                 (tf.ones([2], tf.complex64), "tensors of dtype complex64 are not supported by hvdlite")]
        cases = [([bad], message) for bad, message in cases] if grouped else cases
        cases += [("abc", "expected a list of tf.Tensors, got str")] if grouped else []
        for bad, message in cases:
            try:
                getattr(hvd, name)(bad, *args)
                wrong.append(f"{name}({bad!r}): no error")
            except Exception as exc:  # noqa: BLE001 - every kind is checked below
                if type(exc) is not TypeError or not str(exc).startswith(f"{name}: {message}"):
                    wrong.append(f"{name}({bad!r}): {type(exc).__name__}: {exc}")
    with pytest.raises(TypeError, match="TypeError: allgather: tensors of dtype complex64 are not supported"):
        tf.function(hvd.allgather).get_concrete_function(tf.TensorSpec([2], tf.complex64))
    assert not wrong, "\n".join(wrong)


def test_float16_prescale_in_float32(size: int) -> None:
    got = hvd.allreduce(tf.fill([4], tf.constant(1e-3, tf.float16)), op=hvd.Sum, prescale_factor=1e5).numpy()
    one = np.float16(np.float32(np.float16(1e-3)) * np.float32(1e5))
    expected = one
    for _ in range(size - 1):
        expected = np.float16(expected + one)
    np.testing.assert_array_equal(got, np.full(4, expected, np.float16))
    ints = hvd.allreduce(tf.constant([10, -10, 7], tf.int32), op=hvd.Sum, prescale_factor=0.35).numpy()
    np.testing.assert_array_equal(ints, np.trunc(np.array([10, -10, 7]) * 0.35).astype(np.int32) * size)


def test_gradient_tape_positional_order_and_stable_names(rank: int, size: int) -> None:
    w = tf.Variable([1.0, 2.0], name="conform_w")
    b = tf.Variable(0.5, name="conform_b")
    cache = runtime.state().engine.cache
    valid_counts = []
    for step in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(rank + 1 + step)) + b * float(rank)
        tape = hvd.DistributedGradientTape(tape)
        gw, gb = tape.gradient(loss, [w, b], None, False)  # Horovod: output_gradients, use_generic_names
        mean = sum(r + 1 + step for r in range(size)) / size
        np.testing.assert_allclose(gw.numpy(), [mean, mean], rtol=1e-6)
        np.testing.assert_allclose(gb.numpy(), sum(range(size)) / size, rtol=1e-6)
        valid_counts.append(int(cache.valid.sum()))
    # every step reduces under the same name, so the response cache stops growing after the first one
    assert valid_counts[1] == valid_counts[2] == valid_counts[3], valid_counts
    stats = runtime.state().engine.stats()
    assert isinstance(stats, dict)
