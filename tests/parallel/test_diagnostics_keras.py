"""Keras and TF diagnostics: hvd.check_replicas on Keras models (variables and optimizer state) and TF tensors,
and hvd.callbacks.CheckReplicasCallback in model.fit (equal replicas pass; an unsynchronised
BatchNormalization's moving statistics and a perturbed kernel are named on every rank); straggler attribution
in model.fit (one rank sleeps 20 ms before each batch)."""
from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd_tf  # noqa: E402
import hvdlite.tensorflow.keras as hvd  # noqa: E402
from straggler_check import SLEEP_S, WINDOW, check_report, true_lateness_ms  # noqa: E402

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300
tf.get_logger().setLevel("ERROR")


def _model(batch_norm: bool) -> keras.Model:
    keras.utils.set_random_seed(100 + hvd.rank())  # different on every rank until broadcast
    layers = [keras.Input((6,)), keras.layers.Dense(5, name="hidden")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    model = keras.Sequential(layers + [keras.layers.Dense(2, name="out")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    return model


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)  # each rank its own shard
    return rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)


def test_equal_replicas_pass_in_fit_and_a_perturbed_kernel_is_named(rank: int, size: int) -> None:
    model = _model(batch_norm=False)
    callback = hvd.callbacks.CheckReplicasCallback(every_n_batches=1)
    model.fit(*_data(rank), batch_size=4, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), callback,
                         hvd.callbacks.CheckReplicasCallback()])
    assert callback._batches == 8
    count = hvd.check_replicas(model)
    assert count == len(model.variables) + len(model.optimizer.variables), count
    last = size - 1
    kernel = model.get_layer("out").kernel
    if rank == last:
        kernel.assign_add(np.eye(5, 2, dtype=np.float32) * 0.5)
    with pytest.raises(hvd.ReplicaDivergenceError) as info:
        hvd.check_replicas(model)
    assert info.value.tensor == kernel.path and info.value.ranks == (last,), str(info.value)
    assert info.value.max_abs_diff == pytest.approx(0.5, abs=1e-6)
    assert len(set(hvd_tf.allgather_object(str(info.value)))) == 1


def test_unsynchronised_batch_normalization_is_named_by_the_callback(rank: int, size: int) -> None:
    model = _model(batch_norm=True)
    with pytest.raises(hvd.ReplicaDivergenceError) as info:
        model.fit(*_data(rank), batch_size=4, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                             hvd.callbacks.CheckReplicasCallback(every_n_batches=2)])
    bn = model.get_layer("bn")
    assert info.value.tensor == bn.moving_mean.path, str(info.value)
    assert set(info.value.tensors) == {bn.moving_mean.path, bn.moving_variance.path}, info.value.tensors
    assert info.value.ranks == tuple(range(1, size)), str(info.value)
    means = hvd_tf.allgather_object(bn.moving_mean.numpy().astype(np.float64))
    assert info.value.max_abs_diff == max(float(np.max(np.abs(m - means[0]))) for m in means[1:]) > 0


def test_tf_tensors_and_variables(rank: int, size: int) -> None:
    values = [tf.constant([1.0, 2.0]), tf.Variable(np.arange(3, dtype=np.int64)), np.ones(2, np.float16)]
    assert hvd_tf.check_replicas(values) == 3
    values[1].assign_add([0, rank, 0])
    with pytest.raises(hvd_tf.ReplicaDivergenceError) as info:
        hvd_tf.check_replicas(values)
    assert info.value.tensor == "[1]" and info.value.ranks == tuple(range(1, size)), str(info.value)
    assert info.value.max_abs_diff == size - 1


def test_keras_fit_names_the_rank_that_sleeps(reinit, rank: int, size: int) -> None:
    hvd_keras = hvd
    reinit(straggler_window_ops=WINDOW, straggler_window_seconds=0)  # windows of ops only, as the torch test

    stamps = []

    class Sleep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if rank == size - 1:
                time.sleep(SLEEP_S)
            stamps.append(time.monotonic())

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    data = np.random.default_rng(rank).normal(size=(2, 2 * (2 * WINDOW + 4), 6)).astype(np.float32)
    model.fit(data[0], data[1][:, :1], batch_size=2, epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Sleep()])
    hvd_keras.allreduce(np.zeros(1), name="keras.straggler.end")  # every rank past fit before reading
    check_report(hvd_keras.straggler_report(), size, true_lateness_ms(stamps, size, WINDOW))
