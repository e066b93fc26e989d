"""Programs written for horovod.tensorflow, in eager mode, in tf.function and in a tf.compat.v1 session:
sparse Average (alone and grouped with dense tensors) with Horovod's values and dtypes, the NotImplementedError
of the other sparse ops, broadcast's gradient, broadcast_ on ResourceVariables of every dtype from every root,
and SyncBatchNormalization with the keyword arguments of Horovod's signature."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

import hvdlite.tensorflow as hvd

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300

MODES = ["eager", "function", "session"]
SPARSE_DTYPES = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64, tf.bfloat16]


def run_in(mode: str, build: Callable[[], Any]) -> Any:
    """``build()``'s tensors as numpy values: run eagerly, traced by tf.function, or in a TF1 graph and session."""
    if mode == "eager":
        return tf.nest.map_structure(lambda t: t.numpy(), build())
    if mode == "function":
        return tf.nest.map_structure(lambda t: t.numpy(), tf.function(build)())
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        fetches = build()
        sess.run(tf.compat.v1.global_variables_initializer())
        return sess.run(fetches)


def slices_of(rank: int, dtype: tf.DType) -> tuple[np.ndarray, np.ndarray]:
    """This rank's sparse rows (values, indices): two rows, overlapping the next rank's."""
    values = (np.arange(6).reshape(2, 3) % 4 + rank + 1).astype(np.int64)
    return values, np.array([rank, rank + 1], np.int64)


@pytest.mark.parametrize("mode", MODES)
def test_sparse_average_has_horovods_values_and_dtype_alone_and_grouped_with_dense(rank: int, size: int,
                                                                                 mode: str) -> None:
    for dtype in SPARSE_DTYPES:
        values, indices = slices_of(rank, dtype)
        dense_value = np.array([[2, 4], [6, 8]], np.int64)  # the same on every rank: its average is itself

        def build() -> Any:
            s = tf.IndexedSlices(tf.cast(values, dtype), tf.constant(indices), tf.constant([size + 1, 3], tf.int64))
            alone = hvd.allreduce(s, op=hvd.Average)
            grouped = hvd.grouped_allreduce([tf.cast(dense_value, dtype), s, s], op=hvd.Average)
            # Horovod's definition: the gathered values divided by the size with TensorFlow's `/`, here in
            # the same mode (a graph may divide by a constant as a multiplication by its reciprocal)
            horovod = hvd.allgather(tf.cast(values, dtype)) / tf.cast(size, dtype)
            return [alone.values, alone.indices, grouped[0], grouped[1].values, grouped[2].values,
                    grouped[2].indices, horovod]

        alone, alone_indices, dense, g1, g2, g_indices, expected = run_in(mode, build)
        all_indices = np.concatenate([slices_of(r, dtype)[1] for r in range(size)])
        expected_dtype = {tf.uint8: np.float32, tf.int8: np.float32, tf.int32: np.float64, tf.int64: np.float64}
        assert expected.dtype == expected_dtype.get(dtype, dtype.as_numpy_dtype)
        gathered = np.concatenate([slices_of(r, dtype)[0] for r in range(size)])
        np.testing.assert_allclose(expected.astype(np.float64), gathered / size, rtol=1e-2)  # the reference itself
        for got in (alone, g1, g2):
            assert got.dtype == expected.dtype, (dtype, got.dtype)
            np.testing.assert_array_equal(got, expected, err_msg=f"{dtype.name} {mode}")
        np.testing.assert_array_equal(alone_indices, all_indices)
        np.testing.assert_array_equal(g_indices, all_indices)
        assert dense.dtype == dtype.as_numpy_dtype
        np.testing.assert_array_equal(dense.astype(np.int64), dense_value, err_msg=f"{dtype.name} {mode}")


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sparse_ops_other_than_sum_and_average_raise_not_implemented(mode: str) -> None:
    def call(op: Any, grouped: bool) -> Any:
        s = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([2, 2]))
        if grouped:
            return hvd.grouped_allreduce([tf.ones([2]), s], op=op)
        return hvd.allreduce(s, op=op)

    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        for grouped in (False, True):
            with pytest.raises(NotImplementedError, match="sparse"):
                call(op, grouped) if mode == "eager" else tf.function(lambda: call(op, grouped))()
    out = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)  # nothing was left half-submitted
    assert out.numpy().tolist() == [float(hvd.size())]


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_gradient_is_the_average_on_the_root_and_zero_elsewhere(rank: int, size: int, mode: str) -> None:
    for dtype in (tf.float32, tf.float64):
        for root in range(size):
            def build() -> Any:
                x = tf.cast(tf.ones([5, 2]) * rank, dtype)
                if mode == "session":
                    return tf.gradients(hvd.broadcast(x, root), x, tf.ones([5, 2], dtype) * (rank + 1))[0]
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = hvd.broadcast(x, root) * tf.cast(rank + 1, dtype)
                return tape.gradient(y, x)

            grad = run_in(mode, build)
            expected = (size + 1) / 2 if rank == root else 0.0  # mean of 1..size on the root
            np.testing.assert_array_equal(grad, np.full([5, 2], expected, dtype.as_numpy_dtype),
                                          err_msg=f"{dtype.name} root {root} {mode}")


BROADCAST_DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
                    tf.float64, tf.bool]


@pytest.mark.parametrize("mode", MODES)
def test_inplace_broadcast_of_resource_variables_every_dtype_and_root(rank: int, size: int, mode: str) -> None:
    for dtype in BROADCAST_DTYPES:
        for root in range(size):
            def value(r: int) -> np.ndarray:
                v = np.arange(6).reshape(3, 2) + 10 * r
                return (v % 2 == 1) if dtype == tf.bool else v

            def build() -> Any:
                var = resource_variable_ops.ResourceVariable(tf.cast(value(rank), dtype))
                if mode == "function":
                    out = tf.function(lambda: hvd.broadcast_([var], root))()
                else:
                    out = hvd.broadcast_([var], root)
                assert len(out) == 1 and out[0].dtype.base_dtype == dtype
                return [out[0], var]

            # in a session, the returned tensor and the variable are fetched by separate runs, as
            # Horovod's test does: evaluating the result must have assigned the variable
            if mode == "session":
                with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
                    result, var = build()
                    sess.run(var.initializer)
                    got, after = sess.run(result), sess.run(var)
            else:
                got, after = [t.numpy() for t in build()]
            expected = tf.cast(value(root), dtype).numpy()
            np.testing.assert_array_equal(got, expected, err_msg=f"{dtype.name} root {root} {mode}")
            np.testing.assert_array_equal(after, expected, err_msg=f"{dtype.name} root {root} {mode}")


HOROVOD_SYNC_BN_KWARGS = dict(  # every keyword of Horovod's SyncBatchNormalization (Keras 2 BatchNormalization's)
    axis=-1, momentum=0.5, epsilon=1e-3, center=True, scale=True, beta_initializer="zeros",
    gamma_initializer="ones", moving_mean_initializer="zeros", moving_variance_initializer="ones",
    beta_regularizer=None, gamma_regularizer=None, beta_constraint=None, gamma_constraint=None, renorm=False,
    renorm_clipping=None, renorm_momentum=0.99, fused=False, trainable=True, virtual_batch_size=None,
    adjustment=None, name="sync_bn")


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sync_batch_norm_takes_horovods_signature(rank: int, size: int, mode: str) -> None:
    data = [np.arange(6, dtype=np.float32).reshape(3, 2) * (r + 1) for r in range(size)]
    layer = hvd.SyncBatchNormalization(**HOROVOD_SYNC_BN_KWARGS)
    call = (lambda x: layer(x, training=True)) if mode == "eager" else tf.function(lambda x: layer(x, training=True))
    out = call(tf.constant(data[rank])).numpy()
    whole = np.concatenate(data).astype(np.float64)
    expected = (data[rank] - whole.mean(axis=0)) / np.sqrt(whole.var(axis=0) + 1e-3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert layer.name == "sync_bn"
