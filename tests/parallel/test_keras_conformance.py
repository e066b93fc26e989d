"""Horovod Keras programs run unchanged: DistributedOptimizer / PartialDistributedOptimizer with Horovod's
positional orders (local layers keep local gradients), BroadcastGlobalVariablesCallback(root_rank, device,
local_variables) and register_local_var, BestModelCheckpoint's positional order and its filepath attribute,
load_model(..., legacy_opts), elastic KerasState; a model and an optimizer of different Keras are refused. Runs
under Keras 3 and, in the TF_USE_LEGACY_KERAS=1 variant, under tf-keras (Keras 2)."""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import hvdlite.tensorflow as hvd_tf
import hvdlite.tensorflow.keras as hvd
from keras_family import LEGACY, SGD, SUFFIX, apply, keras, optimizer_variables, variable

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300
VARIANTS = ("", "TF_USE_LEGACY_KERAS=1")


def small_model(rank: int) -> keras.Model:
    keras.utils.set_random_seed(40 + rank)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="shared"),
                             keras.layers.Dense(2, name="local")])


def test_distributed_optimizer_positional_order() -> None:
    opt = hvd.DistributedOptimizer(SGD(0.1), "dist", "", "", hvd.Compression.fp16, True, 1.0,
                                   hvd.Sum, 2, True, 0, None, hvd.global_process_set, False)
    s = opt._hvd.settings
    assert (opt._name if LEGACY else opt.name, s["compression"], s["sparse_as_dense"], s["op"],
            s["backward_passes_per_step"],
            s["average_aggregated_gradients"], s["scale_local_gradients"]) == \
        ("dist", hvd.Compression.fp16, True, hvd.Sum, 2, True, False)
    with pytest.raises(ValueError, match="op currently only supports hvd.Average, hvd.Sum and hvd.Adasum"):
        hvd.DistributedOptimizer(SGD(0.1), op=hvd.Max)


def test_partial_distributed_optimizer_keeps_local_gradients(rank: int, size: int) -> None:
    model = small_model(0)  # the same weights everywhere
    opt = hvd.PartialDistributedOptimizer(SGD(1.0), None, "", "", hvd.Compression.none, False,
                                          1.0, hvd.Average, 1, False, None, hvd.global_process_set,
                                          model.get_layer("local"))
    before = [w.numpy().copy() for w in model.trainable_weights]
    x = tf.constant(np.full((2, 3), rank + 1.0, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_weights)
    everyone = hvd_tf.allgather_object([g.numpy() for g in grads])
    apply(opt, grads, model.trainable_weights)
    local_ids = {id(w) for w in model.get_layer("local").trainable_weights}
    for i, (w, old) in enumerate(zip(model.trainable_weights, before)):
        if id(w) in local_ids:  # not reduced: this rank's own gradient, divided by the size (Horovod's scaling)
            np.testing.assert_allclose(w.numpy(), old - everyone[rank][i] / size, rtol=1e-6, atol=1e-6)
        else:
            mean = sum(g[i] for g in everyone) / size
            np.testing.assert_allclose(w.numpy(), old - mean, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="local_layers must be Keras layers"):
        hvd.PartialDistributedOptimizer(SGD(1.0), local_layers=["dense"])


def test_broadcast_callback_leaves_local_variables_alone(rank: int, size: int) -> None:
    model = small_model(rank)
    model.compile(optimizer=hvd.DistributedOptimizer(SGD(0.1)), loss="mse")
    local_kernel = model.get_layer("local").kernel
    key = (lambda w: w.name) if LEGACY else (lambda w: w.path)
    mine = {key(w): w.numpy().copy() for w in model.weights}
    root = size - 1
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root, "", local_kernel)
    callback.register_local_var(model.get_layer("local").bias)
    callback.set_model(model)
    callback.on_train_begin()
    roots = hvd_tf.broadcast_object(mine, root_rank=root)
    for w in model.weights:
        keep = key(w) in (key(local_kernel), key(model.get_layer("local").bias))
        np.testing.assert_array_equal(w.numpy(), mine[key(w)] if keep else roots[key(w)])
    with pytest.raises(ValueError, match="All local variables must be of tf.Variable type"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)])


def test_best_model_checkpoint_positional_order_and_filepath(rank: int) -> None:
    """(Keras 3's ModelCheckpoint underneath; under tf-keras it checks the same on a Keras 3 model.)"""
    k3 = __import__("keras")
    callback = hvd.callbacks.BestModelCheckpoint("loss", 0, True, "min", "epoch")
    assert (callback.monitor, callback.save_weights_only, callback.save_best_only, callback.save_freq,
            callback.filepath) == ("loss", True, True, "epoch", None)
    k3.utils.set_random_seed(40 + rank)
    model = k3.Sequential([k3.Input((3,)), k3.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(k3.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"set callback.filepath = 'best.keras' \(as Horovod's Spark estimator"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[callback])
    directory = hvd_tf.broadcast_object(tempfile.mkdtemp(prefix="hvdlite-best-") if rank == 0 else None)
    callback.filepath = os.path.join(directory, f"best.{rank}.weights.h5")  # as Horovod's estimator sets it
    model.fit(x, y, epochs=2, verbose=0, callbacks=[callback])
    hvd.allreduce(0.0, name="after.fit")  # every rank has finished fit
    written = sorted(os.listdir(directory))
    assert written == ["best.0.weights.h5"], written


def test_load_model_accepts_legacy_opts(rank: int) -> None:
    """Keras 3 ignores legacy_opts; tf-keras loads a legacy optimizer as its legacy class."""
    model = small_model(0)
    adam = keras.optimizers.legacy.Adam if LEGACY else keras.optimizers.Adam
    model.compile(optimizer=hvd.DistributedOptimizer(adam(0.01)), loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32), epochs=1, verbose=0)
    path = os.path.join(tempfile.mkdtemp(prefix=f"hvdlite-load-{rank}-"), "m" + SUFFIX)
    model.save(path)
    for legacy in (False, True):
        loaded = hvd.load_model(path, None, None, hvd.Compression.none, legacy)
        assert isinstance(loaded.optimizer, adam) and hasattr(loaded.optimizer, "_hvd"), type(loaded.optimizer)
        assert int(loaded.optimizer.iterations.numpy()) == 1


def test_keras_state_commits_and_restores_model_and_optimizer(rank: int, size: int) -> None:
    """hvd.elastic.KerasState with the elastic callbacks in fit: commit, restore, sync from rank 0."""
    model = small_model(rank)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    x, y = np.ones((8, 3), np.float32) * (rank + 1), np.zeros((8, 2), np.float32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.elastic.UpdateEpochStateCallback(state),
                         hvd.elastic.UpdateBatchStateCallback(state),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=1)])
    assert (state.epoch, state.batch) == (2, 0)
    committed = [w.copy() for w in model.get_weights()]
    committed += [v.numpy().copy() for v in optimizer_variables(model.optimizer)]
    assert int(model.optimizer.iterations.numpy()) == 4
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # uncommitted progress, then back to the commit
    state.restore()
    now = model.get_weights() + [v.numpy() for v in optimizer_variables(model.optimizer)]
    for a, b in zip(now, committed):
        np.testing.assert_array_equal(a, b)
    if rank == 0:
        model.set_weights([w + 1.0 for w in model.get_weights()])
    state.sync()  # everyone takes rank 0's state
    everyone = hvd_tf.allgather_object([w for w in model.get_weights()])
    for other in everyone:
        for a, b in zip(other, model.get_weights()):
            np.testing.assert_array_equal(a, b)


def test_a_model_and_an_optimizer_of_different_keras_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    """Keras 3 with tf-keras (or the reverse) is refused naming both and TF_USE_LEGACY_KERAS; wrapping an
    optimizer of the Keras that tf.keras is not warns (compile() would refuse the mix with an obscure error)."""
    import keras as k3
    import tf_keras as k2

    for model_keras, opt_keras in ((k3, k2), (k2, k3)):
        model = model_keras.Sequential([model_keras.Input((3,)), model_keras.layers.Dense(2)])
        caplog.clear()
        hvdlite_logger = logging.getLogger("hvdlite")  # it does not propagate: give it pytest's handler
        hvdlite_logger.addHandler(caplog.handler)
        try:
            optimizer = hvd.DistributedOptimizer(opt_keras.optimizers.SGD(0.1))
        finally:
            hvdlite_logger.removeHandler(caplog.handler)
        warned = [rec.getMessage() for rec in caplog.records if "while tf.keras is" in rec.getMessage()]
        assert len(warned) == (1 if (opt_keras is k3) == LEGACY else 0), warned
        pattern = r"the model \(.*\) is (Keras 3|tf-keras \(Keras 2\)) but the optimizer .* is " \
                  r"(tf-keras \(Keras 2\)|Keras 3).*TF_USE_LEGACY_KERAS=1"
        with pytest.raises(ValueError, match=pattern):
            hvd.elastic.KerasState(model, optimizer)
        model.optimizer = optimizer  # as if compile had taken it
        callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        callback.set_model(model)
        with pytest.raises(ValueError, match=pattern):
            callback.on_train_begin()
        with pytest.raises(ValueError, match=r"the optimizer .* but the local layer .*TF_USE_LEGACY_KERAS"):
            hvd.PartialDistributedOptimizer(opt_keras.optimizers.SGD(0.1), local_layers=model.layers[0])


def _aggregation_case(rank: int, size: int, op: object, average: bool, local: bool) -> None:
    """backward_passes_per_step=2 through apply_gradients: a dense and a sparse (tf.gather) gradient, one
    variable local; the first pass of the first cycle has an infinite gradient, which must not leak into the
    second cycle. Checks the weights after each pass against the arithmetic."""
    plain = keras.optimizers.legacy.SGD(1.0) if LEGACY else keras.optimizers.SGD(1.0)
    opt = hvd.DistributedOptimizer(plain, op=op, backward_passes_per_step=2, average_aggregated_gradients=average)
    a, b = variable(np.zeros(2, np.float32)), variable(np.zeros(3, np.float32))
    if local:
        opt.register_local_var(a)
    factor = (1.0 / size if op is hvd.Average else 1.0) * (0.5 if average else 1.0)
    local_factor = (1.0 / size) * (0.5 if average else 1.0)
    expected_a, expected_b = np.zeros(2), np.zeros(3)
    for step in range(4):
        grad_a = tf.constant([np.inf if step == 0 else rank + 1.0, 1.0], tf.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(b, [0, 2]) * (rank + 1.0))
        grad_b = tape.gradient(loss, b)
        assert isinstance(grad_b, tf.IndexedSlices)
        apply(opt, [grad_a, grad_b], [a, b])
        if step % 2 == 1:  # the reducing pass: the sums of both passes, reduced, then applied
            mine = np.array([(np.inf if step == 1 else rank + 1.0) + rank + 1.0, 2.0])
            summed_a = mine * local_factor if local else \
                np.array([(np.inf if step == 1 else 2 * sum(range(1, size + 1))), 2.0 * size]) * factor
            expected_a -= summed_a
            expected_b -= np.array([1, 0, 1]) * 2 * (sum(range(1, size + 1))) * factor
        np.testing.assert_allclose(np.asarray(a), expected_a, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(b), expected_b, rtol=1e-6)
        assert int(opt.iterations.numpy()) == step + 1
        assert int(opt._agg_helper.counter.numpy()) == (step + 1) % 2


@pytest.mark.parametrize("op,average,local", [(hvd.Average, False, False), (hvd.Sum, True, False),
                                              (hvd.Average, True, True)])
def test_backward_passes_aggregate_sparse_local_and_inf_gradients(rank: int, size: int, op: object,
                                                                   average: bool, local: bool) -> None:
    _aggregation_case(rank, size, op, average, local)


if LEGACY:  # _compute_gradients is the hook of tf-keras' legacy optimizers (tests here must not skip)
    def test_legacy_compute_gradients_reduces_and_aggregates_as_horovods(rank: int, size: int) -> None:
        """tf-keras legacy: _compute_gradients (minimize's hook, which Horovod's Keras 2 code calls) returns the
        reduced gradients; apply_gradients of those does not reduce again; with backward_passes_per_step=2 it
        applies on every second call only, and _agg_helper.counter counts the passes."""
        x = tf.Variable([1.0, 2.0])
        opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.5), op=hvd.Sum)
        assert opt._agg_helper is None
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(x * (rank + 1.0)), var_list=[x])
        total = sum(range(1, size + 1))
        np.testing.assert_allclose(pairs[0][0].numpy(), [total, total])
        opt.apply_gradients(pairs)  # applied as reduced, not summed over the ranks once more
        np.testing.assert_allclose(x.numpy(), [1.0 - 0.5 * total, 2.0 - 0.5 * total])
        y = tf.Variable([0.0])
        agg = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(1.0), backward_passes_per_step=2)

        @tf.function
        def step() -> None:
            agg.apply_gradients(agg._compute_gradients(lambda: y * (rank + 1.0), var_list=[y]),
                                experimental_aggregate_gradients=False)
        for i in range(5):
            step()
            assert int(agg._agg_helper.counter.numpy()) == (i + 1) % 2
            assert int(agg.iterations.numpy()) == i + 1
            np.testing.assert_allclose(y.numpy(), [-((i + 1) // 2) * 2 * total / size], rtol=1e-6)
        agg.minimize(lambda: y * (rank + 1.0), var_list=[y])  # minimize goes through _compute_gradients too
        assert int(agg._agg_helper.counter.numpy()) == 0
        np.testing.assert_allclose(y.numpy(), [-3 * 2 * total / size], rtol=1e-6)

    def test_compute_gradients_of_a_2_11_optimizer_reduces_and_aggregates(rank: int, size: int) -> None:
        """tf-keras 2.11+ (no _compute_gradients of its own): Horovod's test_tensorflow2_keras.py calls
        opt._compute_gradients on them; it is their compute_gradients, reduced, and aggregated in a tf.function
        (it raised AttributeError); a grad_loss, which compute_gradients has not, is refused."""
        x = tf.Variable([1.0, 2.0])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), op=hvd.Sum)
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(x * (rank + 1.0)), var_list=[x])
        total = sum(range(1, size + 1))
        np.testing.assert_allclose(pairs[0][0].numpy(), [total, total])
        opt.apply_gradients(pairs)
        np.testing.assert_allclose(x.numpy(), [1.0 - 0.5 * total, 2.0 - 0.5 * total])
        y = tf.Variable([0.0])
        agg = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)

        @tf.function
        def step() -> None:
            agg.apply_gradients(agg._compute_gradients(lambda: y * (rank + 1.0), var_list=[y]))
        for i in range(4):
            step()
            assert int(agg._agg_helper.counter.numpy()) == (i + 1) % 2
            assert int(agg.iterations.numpy()) == i + 1
            np.testing.assert_allclose(y.numpy(), [-((i + 1) // 2) * 2 * total / size], rtol=1e-6)
        with pytest.raises(ValueError, match="takes no grad_loss"):
            opt._compute_gradients(lambda: tf.reduce_sum(x), var_list=[x], grad_loss=tf.constant(1.0))


def test_tf_keras_found_after_from_tensorflow_keras_import(rank: int, caplog: pytest.LogCaptureFixture) -> None:
    """`from tensorflow.keras import ...` renames tf.keras to "tensorflow.keras"; the Keras it stands for is
    still told right (from its classes): no false warning, and hvd.load_model loads a tf-keras .h5 with tf-keras."""
    from tensorflow.keras import layers, models  # noqa: F401 - the usual Keras 2 import style
    assert tf.keras.__name__ == "tensorflow.keras"
    hvdlite_logger = logging.getLogger("hvdlite")
    hvdlite_logger.addHandler(caplog.handler)
    try:
        caplog.clear()
        opt = hvd.DistributedOptimizer(SGD(0.1))
        warned = [rec.getMessage() for rec in caplog.records if "while tf.keras is" in rec.getMessage()]
        assert warned == [], warned
    finally:
        hvdlite_logger.removeHandler(caplog.handler)
    model = models.Sequential([layers.Dense(2, input_shape=(3,))])
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32), epochs=1, verbose=0)
    path = os.path.join(tempfile.mkdtemp(prefix=f"hvdlite-tfk-{rank}-"), "m" + SUFFIX)
    model.save(path)
    loaded = hvd.load_model(path)
    assert isinstance(loaded, keras.Model) and hasattr(loaded.optimizer, "_hvd"), type(loaded)
    assert int(loaded.optimizer.iterations.numpy()) == 1


def test_sync_batch_norm_is_a_layer_of_the_keras_tf_keras_is(rank: int, size: int) -> None:
    """hvd.SyncBatchNormalization(axis=1, fused=False) (Horovod's keywords) is a layer of the Keras tf.keras
    stands for; under tf-keras it also works in a tf.compat.v1 session (its moving statistics fetched there),
    as Horovod's test_horovod_syncbn_cpu runs it. Its output and moving mean are those of the whole batch."""
    data = [np.arange(8, dtype=np.float32).reshape(4, 2) * (r + 1) + r for r in range(size)]
    whole = np.concatenate(data).astype(np.float64)
    expected = (data[rank] - whole.mean(axis=0)) / np.sqrt(whole.var(axis=0) + 1e-3)
    modes = ["eager", "session"] if LEGACY else ["eager"]
    for mode in modes:
        with (tf.Graph().as_default() if mode == "session" else contextlib.nullcontext()):
            layer = hvd_tf.SyncBatchNormalization(axis=1, fused=False, momentum=0.0)
            assert isinstance(layer, keras.layers.BatchNormalization), type(layer).__mro__
            out = layer(tf.constant(data[rank]), training=True)
            if mode == "session":
                with tf.compat.v1.Session() as sess:
                    sess.run(tf.compat.v1.global_variables_initializer())
                    out = sess.run([out] + layer.updates)[0]  # TF1: the moving averages are update ops
                    moving_mean = sess.run(layer.moving_mean)
            else:
                out, moving_mean = out.numpy(), np.asarray(layer.moving_mean)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(moving_mean, whole.mean(axis=0), rtol=1e-5)
