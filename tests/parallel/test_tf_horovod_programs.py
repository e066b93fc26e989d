"""Programs written for horovod.tensorflow, in eager mode, in tf.function and in a tf.compat.v1 session:
sparse Average (alone and grouped with dense tensors) with Horovod's values and dtypes, the NotImplementedError
of the other sparse ops, broadcast's gradient, broadcast_ on ResourceVariables of every dtype from every root,
and SyncBatchNormalization with the keyword arguments of Horovod's signature."""
from __future__ import annotations

import contextlib
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


# -- TF1 optimizers (tf.compat.v1.train.Optimizer) -------------------------------------------------------------
X = np.arange(24, dtype=np.float32).reshape(12, 2) / 10.0
Y = np.array([1, 0, 2, 1, 3, 0, 1, 2, 0, 1, 1, 2], np.float32)
W0 = np.array([[0.5], [-0.25]], np.float32)


def _tf1_optimizer(kind: str) -> Any:
    return tf.compat.v1.train.GradientDescentOptimizer(0.1) if kind == "sgd" else \
        tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)


def _tf1_train(kind: str, x: np.ndarray, y: np.ndarray, mode: str, distributed: bool, steps: int = 3,
               start: np.ndarray = W0) -> np.ndarray:
    """``steps`` minimize() steps of a TF1 optimizer on a linear least-squares model; the final weights."""
    opt = _tf1_optimizer(kind)
    if distributed:
        opt = hvd.DistributedOptimizer(opt)
    if mode == "eager":
        w = tf.Variable(start)
        for _ in range(steps):
            opt.minimize(lambda: tf.reduce_mean((tf.matmul(x, w)[:, 0] - y) ** 2), var_list=[w])
        return w.numpy()
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(start))
        xs, ys = tf.compat.v1.placeholder(tf.float32, [None, 2]), tf.compat.v1.placeholder(tf.float32, [None])
        step = opt.minimize(tf.reduce_mean((tf.matmul(xs, w)[:, 0] - ys) ** 2),
                            global_step=tf.compat.v1.train.get_or_create_global_step())
        hooks = [hvd.BroadcastGlobalVariablesHook(0)] if distributed else []
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            for _ in range(steps):
                sess.run(step, feed_dict={xs: x, ys: y})
            return sess.run(w)


@pytest.mark.parametrize("mode", ["eager", "session"])
@pytest.mark.parametrize("kind", ["sgd", "momentum"])
def test_tf1_distributed_optimizer_equals_one_process(rank: int, size: int, mode: str, kind: str) -> None:
    """hvd.DistributedOptimizer(tf.compat.v1.train.*Optimizer): each rank on its shard equals one process on the
    whole batch; in a session through MonitoredTrainingSession + BroadcastGlobalVariablesHook, which gives every
    rank the root's initial weights (they start different here)."""
    k = len(X) // size
    shard = slice(rank * k, (rank + 1) * k)
    start = W0 + (rank if mode == "session" else 0)
    got = _tf1_train(kind, X[shard], Y[shard], mode, distributed=True, start=start)
    expected = _tf1_train(kind, X[:k * size], Y[:k * size], mode, distributed=False)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert all(np.array_equal(got, other) for other in hvd.allgather_object(got))


def _tf1_aggregation_program(rank: int, size: int, mode: str) -> None:
    """Horovod's legacy-optimizer aggregation check: a gradient of rank (dense), of rank+1 (sparse) and of 1 on
    a local variable; backward_passes_per_step=4, averaged; the variable moves on every 4th step only, and the
    global step advances every step."""
    class Accumulate(tf.compat.v1.train.Optimizer):
        def __init__(self) -> None:
            super().__init__(use_locking=False, name="accumulate")
            self.dense_var, self.sparse_var, self.local_var = (tf.Variable([0.0]), tf.Variable([0.0, 0.0]),
                                                               tf.Variable([0.0]))

        def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
            sparse = tf.IndexedSlices(tf.constant([float(rank + 1)]), tf.constant([1]), tf.constant([2]))
            return [(tf.constant([float(rank)]), self.dense_var), (sparse, self.sparse_var),
                    (tf.constant([1.0]), self.local_var)]

        def _resource_apply_dense(self, grad: Any, var: Any) -> Any:
            return var.assign_add(grad)

    opt = hvd.DistributedOptimizer(Accumulate(), backward_passes_per_step=4, average_aggregated_gradients=True,
                                   sparse_as_dense=True)
    inner = opt._optimizer
    opt.register_local_var(inner.local_var)
    mean_rank = sum(range(size)) / size

    def expected(i: int) -> list:
        done = (i + 1) // 4
        return [[done * mean_rank], [0.0, done * (mean_rank + 1)], [done / size]]

    if mode == "eager":
        global_step = tf.Variable(0, dtype=tf.int64)
        for i in range(10):
            opt.apply_gradients(opt.compute_gradients(), global_step=global_step)
            got = [v.numpy().tolist() for v in (inner.dense_var, inner.sparse_var, inner.local_var)]
            np.testing.assert_allclose(sum(got, []), sum(expected(i), []), rtol=1e-6)
            assert int(global_step.numpy()) == i + 1
        return
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        opt = hvd.DistributedOptimizer(Accumulate(), backward_passes_per_step=4, average_aggregated_gradients=True,
                                       sparse_as_dense=True)
        inner = opt._optimizer
        opt.register_local_var(inner.local_var)
        pairs = opt.compute_gradients()
        global_step = tf.compat.v1.train.get_or_create_global_step()
        with tf.control_dependencies([g for g, _ in pairs]):
            before = global_step + 0
        with tf.control_dependencies([before]):
            update = opt.apply_gradients(pairs, global_step=global_step)
        values = [inner.dense_var.read_value(), inner.sparse_var.read_value(), inner.local_var.read_value()]
        sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
        for i in range(10):
            step, _ = sess.run((before, update))
            assert step == i
            np.testing.assert_allclose(sum([v.tolist() for v in sess.run(values)], []), sum(expected(i), []),
                                       rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "session"])
def test_tf1_distributed_optimizer_aggregates_backward_passes(rank: int, size: int, mode: str) -> None:
    _tf1_aggregation_program(rank, size, mode)


@pytest.mark.mpi(sizes=(2,))
def test_tf1_distributed_optimizer_adasum(rank: int) -> None:
    """op=hvd.Adasum combines the gradients with Adasum: orthogonal ones add up (a session and eagerly)."""
    grad = [[1.0, 0.0], [0.0, 1.0]][rank]
    for mode in ("eager", "session"):
        class Fixed(tf.compat.v1.train.GradientDescentOptimizer):
            def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
                return [(tf.constant(grad), var)]
        with (tf.Graph().as_default() if mode == "session" else contextlib.nullcontext()):
            var = tf.compat.v1.Variable([0.0, 0.0], use_resource=True) if mode == "session" else tf.Variable([0.0, 0.0])
            opt = hvd.DistributedOptimizer(Fixed(1.0), op=hvd.Adasum)
            if mode == "eager":
                opt.apply_gradients(opt.compute_gradients())
                got = var.numpy()
            else:
                update = opt.apply_gradients(opt.compute_gradients())
                with tf.compat.v1.Session() as sess:
                    sess.run(var.initializer)
                    sess.run(update)
                    got = sess.run(var)
        np.testing.assert_allclose(got, [-1.0, -1.0])


def test_tape_splits_local_and_global_gradients(rank: int, size: int) -> None:
    """PartialDistributedGradientTape.get_local_and_global_gradients: (variable, gradient) pairs, local ones
    divided by the size, shared ones averaged."""
    layers = [tf.keras.layers.Dense(1, kernel_initializer="ones", use_bias=False) for _ in range(2)]
    x = tf.constant([[rank + 1.0]])
    with tf.GradientTape(persistent=True) as tape:
        loss = layers[1](layers[0](x))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[layers[0]])
    local, shared = tape.get_local_and_global_gradients(loss, [layers[0].kernel, layers[1].kernel])
    assert [v is layers[0].kernel for v, _ in local] == [True] and [v is layers[1].kernel for v, _ in shared] == [True]
    np.testing.assert_allclose(local[0][1].numpy(), [[(rank + 1.0) / size]])
    np.testing.assert_allclose(shared[0][1].numpy(), [[sum(range(1, size + 1)) / size]])
