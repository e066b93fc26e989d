"""Horovod Keras programs run unchanged: DistributedOptimizer / PartialDistributedOptimizer with Horovod's
positional orders (local layers keep local gradients), BroadcastGlobalVariablesCallback(root_rank, device,
local_variables) and register_local_var, BestModelCheckpoint's positional order and its filepath attribute,
load_model(..., legacy_opts)."""
from __future__ import annotations

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdlite.tensorflow as hvd_tf
import hvdlite.tensorflow.keras as hvd

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300


def small_model(rank: int) -> keras.Model:
    keras.utils.set_random_seed(40 + rank)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="shared"),
                             keras.layers.Dense(2, name="local")])


def test_distributed_optimizer_positional_order() -> None:
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), "dist", "", "", hvd.Compression.fp16, True, 1.0,
                                   hvd.Sum, 2, True, 0, None, hvd.global_process_set, False)
    s = opt._hvd.settings
    assert (opt.name, s["compression"], s["sparse_as_dense"], s["op"], s["backward_passes_per_step"],
            s["average_aggregated_gradients"], s["scale_local_gradients"]) == \
        ("dist", hvd.Compression.fp16, True, hvd.Sum, 2, True, False)
    with pytest.raises(ValueError, match="op currently only supports hvd.Average, hvd.Sum and hvd.Adasum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Max)


def test_partial_distributed_optimizer_keeps_local_gradients(rank: int, size: int) -> None:
    model = small_model(0)  # the same weights everywhere
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), None, "", "", hvd.Compression.none, False,
                                          1.0, hvd.Average, 1, False, None, hvd.global_process_set,
                                          model.get_layer("local"))
    before = [w.numpy().copy() for w in model.trainable_weights]
    x = tf.constant(np.full((2, 3), rank + 1.0, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_weights)
    everyone = hvd_tf.allgather_object([g.numpy() for g in grads])
    opt.apply(grads, model.trainable_weights)
    local_ids = {id(w) for w in model.get_layer("local").trainable_weights}
    for i, (w, old) in enumerate(zip(model.trainable_weights, before)):
        if id(w) in local_ids:  # not reduced: this rank's own gradient, divided by the size (Horovod's scaling)
            np.testing.assert_allclose(w.numpy(), old - everyone[rank][i] / size, rtol=1e-6, atol=1e-6)
        else:
            mean = sum(g[i] for g in everyone) / size
            np.testing.assert_allclose(w.numpy(), old - mean, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="local_layers must be Keras layers"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=["dense"])


def test_broadcast_callback_leaves_local_variables_alone(rank: int, size: int) -> None:
    model = small_model(rank)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    local_kernel = model.get_layer("local").kernel
    mine = {w.path: w.numpy().copy() for w in model.weights}
    root = size - 1
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root, "", local_kernel)
    callback.register_local_var(model.get_layer("local").bias)
    callback.set_model(model)
    callback.on_train_begin()
    roots = hvd_tf.broadcast_object(mine, root_rank=root)
    for w in model.weights:
        keep = w.path in (local_kernel.path, model.get_layer("local").bias.path)
        np.testing.assert_array_equal(w.numpy(), mine[w.path] if keep else roots[w.path])
    with pytest.raises(ValueError, match="All local variables must be of tf.Variable type"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)])


def test_best_model_checkpoint_positional_order_and_filepath(rank: int) -> None:
    callback = hvd.callbacks.BestModelCheckpoint("loss", 0, True, "min", "epoch")
    assert (callback.monitor, callback.save_weights_only, callback.save_best_only, callback.save_freq,
            callback.filepath) == ("loss", True, True, "epoch", None)
    model = small_model(rank)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
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
    model = small_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32), epochs=1, verbose=0)
    path = os.path.join(tempfile.mkdtemp(prefix=f"hvdlite-load-{rank}-"), "m.keras")
    model.save(path)
    for legacy in (False, True):
        loaded = hvd.load_model(path, None, None, hvd.Compression.none, legacy)
        assert isinstance(loaded.optimizer, keras.optimizers.Adam) and hasattr(loaded.optimizer, "_hvd")
        assert int(loaded.optimizer.iterations.numpy()) == 1
