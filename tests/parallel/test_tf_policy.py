"""The shared policy on the TF side, and TF1 sessions: SyncBatchNormalization (two-pass statistics, gradients,
process_set=, Horovod's keyword arguments), sparse reductions, Compression.bf16 and bf16_fp32acc, the runtime
re-export, and broadcast_global_variables / BroadcastGlobalVariablesHook in a real tf.compat.v1 graph and session."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import hvdlite.keras as hvdk
import hvdlite.tensorflow as hvd
from hvdlite import core

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300


def rows(size: int) -> list[np.ndarray]:
    # a large offset: a one-pass E[x^2] - E[x]^2 in float32 loses the variance; two passes keep it
    return [(1e4 + np.random.default_rng(7 + k).normal(0.0, 0.5, size=(k + 2, 3))).astype(np.float32)
            for k in range(size)]


def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch_with_gradients(rank: int, size: int) -> None:
    import keras
    data = rows(size)
    sync_bn = hvd.SyncBatchNormalization(momentum=0.5, fused=True)
    plain_bn = keras.layers.BatchNormalization(momentum=0.5, dtype="float64")  # the exact reference
    x_all = tf.constant(np.concatenate(data).astype(np.float64))
    weights = tf.constant(np.random.default_rng(1).normal(size=x_all.shape))
    offset = sum(len(d) for d in data[:rank])
    x = tf.constant(data[rank])
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = sync_bn(x, training=True)
        loss = tf.reduce_sum(out * tf.cast(weights[offset:offset + len(data[rank])], tf.float32))
    grad = tape.gradient(loss, x)
    with tf.GradientTape() as ref_tape:
        ref_tape.watch(x_all)
        ref = plain_bn(x_all, training=True)
        ref_loss = tf.reduce_sum(ref * weights)
    ref_grad = ref_tape.gradient(ref_loss, x_all)
    mine = slice(offset, offset + len(data[rank]))
    # float32 inputs near 1e4 carry ~1e-3 absolute rounding, which is what these tolerances allow
    np.testing.assert_allclose(out.numpy(), ref.numpy()[mine], rtol=0, atol=5e-3)
    np.testing.assert_allclose(grad.numpy(), ref_grad.numpy()[mine], rtol=0, atol=5e-3)
    np.testing.assert_allclose(sync_bn.moving_mean.numpy(), plain_bn.moving_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(sync_bn.moving_variance.numpy(), plain_bn.moving_variance.numpy(), rtol=1e-3)
    variance = np.concatenate(data).astype(np.float64).var(axis=0)
    np.testing.assert_allclose((sync_bn.moving_variance.numpy() - 0.5) / 0.5, variance, rtol=2e-2)


@pytest.mark.mpi(min_size=3)
def test_sync_batch_norm_on_a_process_set(rank: int) -> None:
    pair = hvd.add_process_set([0, 1])
    try:
        data = rows(3)
        bn = hvd.SyncBatchNormalization(process_set=pair, momentum=0.0)
        bn(tf.constant(data[rank]), training=True)
        expected = np.concatenate(data[:2]).mean(axis=0) if rank < 2 else data[2].mean(axis=0)
        np.testing.assert_allclose(bn.moving_mean.numpy(), expected, rtol=1e-6)
    finally:
        hvd.remove_process_set(pair)


def test_sync_batch_norm_keyword_arguments() -> None:
    for fused in (True, False, None):
        layer = hvdk.SyncBatchNormalization(fused=fused, virtual_batch_size=None, adjustment=None)
        assert layer.name.startswith("sync_batch_normalization") and layer.process_set is hvd.global_process_set
    with pytest.raises(ValueError, match="virtual_batch_size=8 is not supported: Keras 3 dropped"):
        hvd.SyncBatchNormalization(virtual_batch_size=8)
    with pytest.raises(ValueError, match="do not pass synchronized=True"):
        hvd.SyncBatchNormalization(synchronized=True)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_sparse_reductions(rank: int, size: int, mode: str) -> None:
    def run(op):
        slices = tf.IndexedSlices(tf.fill([1, 2], rank + 1.0), tf.constant([rank]), dense_shape=tf.constant([size, 2]))
        return hvd.allreduce(slices, op=op)
    call = run if mode == "eager" else (lambda op: tf.function(lambda: run(op))())
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / size)):
        out = call(op)
        assert isinstance(out, tf.IndexedSlices)
        np.testing.assert_array_equal(out.indices.numpy(), np.arange(size))
        np.testing.assert_allclose(out.values.numpy(), np.repeat(np.arange(1.0, size + 1), 2).reshape(size, 2) * scale)
    with pytest.raises(NotImplementedError, match="only hvd.Average and hvd.Sum are defined for sparse tensors"):
        run(hvd.Max)
    with pytest.raises(NotImplementedError, match="prescale_factor/postscale_factor are not supported"):
        hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), prescale_factor=2.0)


def test_compression_bf16(size: int) -> None:
    x = tf.constant([1.0 + 2.0 ** -10, 3.0], tf.float32)  # 1 + 2^-10 is not a bfloat16: it rounds to 1
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(out.numpy(), np.array([size * 1.0, size * 3.0], np.float32))
    exact = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.none)
    np.testing.assert_array_equal(exact.numpy(), np.array([size * (1.0 + 2.0 ** -10), size * 3.0], np.float32))
    ints = hvd.allreduce(tf.constant([5], tf.int32), op=hvd.Sum, compression=hvd.Compression.bf16)
    assert ints.dtype == tf.int32 and ints.numpy().tolist() == [5 * size]


def test_gradient_predivide_factor_divides_before_the_sum(size: int) -> None:
    """DistributedGradientTape's gradient_predivide_factor=f divides each rank's gradient by f before the sum
    and multiplies the average by f after it (core.frontend.gradient_scales, shared with torch's optimizers):
    a float16 sum that overflows without it stays finite and exact with it."""
    value = 49152.0  # 1.5 * 2**15: exact in float16, and divided by 2 or 3; twice it overflows float16 (65504)
    v = tf.Variable(np.zeros(4, np.float32))
    for factor, want in ((float(size), value), (1.0, np.inf)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * value)
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16, gradient_predivide_factor=factor)
        np.testing.assert_array_equal(tape.gradient(loss, [v])[0].numpy(), np.full(4, want, np.float32))


def _bf16(values: np.ndarray) -> np.ndarray:
    return tf.cast(tf.cast(values, tf.bfloat16), tf.float32).numpy()


def test_compression_bf16_fp32acc(rank: int, size: int) -> None:
    """bf16 on the wire, float32 sums: DistributedGradientTape and the Keras DistributedOptimizer average each
    element as the rank-order float32 sum of every rank's value rounded once to bfloat16, divided (in double)
    and rounded once (reference made with TensorFlow's own casts); a tf.IndexedSlices under it is refused."""
    import keras
    mine = (np.random.default_rng(rank).standard_normal(37) * 10.0 ** (rank - 1)).astype(np.float32)
    everyone = hvd.allgather(tf.constant(mine[None]), name="acc.all").numpy()
    total = _bf16(everyone[0])
    for row in everyone[1:]:
        total = total + _bf16(row)
    want = _bf16((total.astype(np.float64) * (1.0 / size)).astype(np.float32))
    v = tf.Variable(np.zeros(37, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * tf.constant(mine))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.bf16_fp32acc)
    assert np.array_equal(tape.gradient(loss, [v])[0].numpy(), want)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=hvdk.Compression.bf16_fp32acc)
    opt.apply_gradients([(tf.constant(mine), v)])  # the reduced gradient, applied with lr 1
    assert np.array_equal(v.numpy(), -want)
    slices = tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 1]), tf.constant([4, 3]))
    with pytest.raises(ValueError, match="is sparse, and sparse gradients are allgathered uncompressed"):
        hvd.allreduce(slices, compression=hvd.Compression.bf16_fp32acc, name="acc.sparse")
    out = hvd.allreduce(tf.convert_to_tensor(slices), op=hvd.Sum, compression=hvd.Compression.bf16_fp32acc,
                        name="acc.dense")
    assert np.array_equal(out.numpy()[:2], np.full((2, 3), float(size), np.float32))


#: Core names that are not part of the runtime every frontend re-exports (collectives have framework versions).
# check_replicas: each frontend has its own, which also takes its framework's models and tensors (asserted below)
NOT_RUNTIME = ("Config", "engine_stats", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
               "check_replicas",
               "grouped_", "synchronize", "poll", "join", "barrier")


def test_runtime_names_are_the_core_objects() -> None:
    runtime = [name for name in core.__all__ if not name.startswith(NOT_RUNTIME)]
    assert {"init", "rank", "Average", "ProcessSet", "HvdliteError", "nccl_built"} <= set(runtime)
    for module in (hvd, hvdk):
        for name in runtime:
            assert getattr(module, name) is getattr(core, name), (module.__name__, name)
            assert name in module.__all__, (module.__name__, name)
    assert hvd.Adasum is core.Adasum and hvdk.PartialDistributedOptimizer is not None
    for module in (hvd, hvdk):
        assert "check_replicas" in module.__all__ and module.check_replicas is not core.check_replicas


def test_autograph_calls_hvdlite_unconverted_and_a_custom_loop_still_trains(rank: int, size: int) -> None:
    """AutoGraph leaves hvdlite's code as it is (as it does TensorFlow's and Keras'): a user's tf.function that
    reaches the optimizer, the tape or a collective does not parse and transform the library on its first trace;
    the loop's result is still every rank's gradient averaged."""
    import keras
    from tensorflow.python.autograph.impl import conversion

    import hvdlite.tensorflow.keras as hvd_keras
    from hvdlite.tensorflow import reduction
    for function in (reduction.reduce_gradients, hvd.allreduce, hvd.DistributedGradientTape,
                     hvd_keras.DistributedOptimizer):
        assert conversion.is_allowlisted(function), function
    variable = tf.Variable([1.0, 2.0])
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(1.0))
    optimizer.build([variable])

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * float(rank + 1))
        optimizer.apply(tape.gradient(loss, [variable]), [variable])

    step()
    mean = (size + 1) / 2.0  # the average of rank + 1 over the ranks
    np.testing.assert_array_equal(variable.numpy(), np.array([1.0 - mean, 2.0 - mean], np.float32))


def test_broadcast_global_variables_eager_raises_as_horovod() -> None:
    with pytest.raises(RuntimeError, match=r"does not support eager execution. Please use "
                                           r"`hvd.broadcast_variables\(<model/optimizer variables>\)` instead"):
        hvd.broadcast_global_variables(0)


def test_tf1_session_broadcast_and_hook(rank: int, size: int) -> None:
    root = size - 1
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([float(rank), 2.0 * rank]))
        step = tf.compat.v1.train.get_or_create_global_step()
        bcast = hvd.broadcast_global_variables(root)
        assert isinstance(bcast, tf.Operation)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(tf.compat.v1.assign(step, rank + 10))
            sess.run(bcast)
            np.testing.assert_array_equal(sess.run(w), [float(root), 2.0 * root])
            assert sess.run(step) == root + 10
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([rank + 0.5, -float(rank)]))
        train = tf.compat.v1.assign_add(v, [1.0, 1.0])
        hook = hvd.BroadcastGlobalVariablesHook(root, device="")
        assert isinstance(hook, tf.compat.v1.train.SessionRunHook)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            np.testing.assert_array_equal(sess.run(v), [root + 0.5, -float(root)])
            sess.run(train)
            np.testing.assert_array_equal(sess.run(v), [root + 1.5, 1.0 - root])
