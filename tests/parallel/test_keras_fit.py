"""hvdlite.tensorflow.keras on Keras 3, and on tf-keras (Keras 2) in the TF_USE_LEGACY_KERAS=1 variant:
model.fit and custom loops equal single-process training on the concatenated batch (SGD/Adam, legacy SGD,
callbacks, learning-rate schedules, metric averaging), sparse gradients, backward_passes_per_step (also with an
inf gradient), process sets, config round trips, saving and load_model, the XLA error."""
from __future__ import annotations

import gc
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.keras as hvd_alias  # noqa: E402
import hvdlite.tensorflow as hvd_tf  # noqa: E402
import hvdlite.tensorflow.keras as hvd  # noqa: E402
from exact import same  # noqa: E402
from keras_family import LEGACY, SGD, SUFFIX, apply, keras, optimizer_variables, value, variable  # noqa: E402
from hvdlite.tensorflow.keras.optimizer import DistributedOptimizerMixin  # noqa: E402

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 420
VARIANTS = ("", "TF_USE_LEGACY_KERAS=1")
tf.get_logger().setLevel("ERROR")
r, n = hvd.rank(), hvd.size()
N, b = 12, 4  # rows per rank, batch per rank
rng = np.random.default_rng(0)
X = rng.normal(size=(n * N, 6)).astype(np.float32)
Y = (X @ rng.normal(size=(6, 2))).astype(np.float32)
mine = slice(r * N, (r + 1) * N)
tokens = rng.integers(0, 10, size=(n * N, 3))  # drawn right after X and Y, from the same generator
targets = rng.normal(size=(n * N, 1)).astype(np.float32)
# global step i == the concatenation of every rank's i-th local batch
ORDER = np.concatenate([np.arange(k * N + i * b, k * N + (i + 1) * b) for i in range(N // b) for k in range(n)])


def check_close(actual, expected, what, rtol=1e-4, atol=1e-5):
    for a, e in zip(actual, expected):
        if a.shape != e.shape or not np.allclose(a, e, rtol=rtol, atol=atol):
            raise AssertionError(f"rank {r}: {what}: max difference {np.abs(a - e).max()}")


def identical_everywhere(weights, what):
    everyone = hvd_tf.allgather_object([np.asarray(w) for w in weights])
    for k, other in enumerate(everyone):
        if not all(np.array_equal(a, o) for a, o in zip(weights, other)):
            raise AssertionError(f"rank {r}: {what}: weights differ from rank {k}")


def make_model(seed, inputs=6):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(2)])


class Before(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.raw = dict(logs)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.lrs, self.epoch_logs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(value(self.model.optimizer.learning_rate))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def lr_callbacks(initial_lr):
    return [hvd.callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=2, verbose=1),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr, multiplier=0.5, start_epoch=2)]



OPTIMIZERS = {"SGD": lambda: keras.optimizers.SGD(0.05, momentum=0.9), "Adam": lambda: keras.optimizers.Adam(0.01)}
if LEGACY:  # Keras 2: a Horovod-era legacy optimizer (lr=) and a 2.11+ one
    OPTIMIZERS = {"legacy.SGD": lambda: SGD(lr=0.05, momentum=0.9), "Adam": lambda: keras.optimizers.Adam(0.01)}
EPOCHS = 3


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_fit_equals_single_process_training(optimizer_name: str) -> None:
    """model.fit on k ranks x batch b == one process on the concatenated batch, with the lr warm-up and
    schedule callbacks and averaged epoch metrics."""
    make_opt = OPTIMIZERS[optimizer_name]
    model = make_model(seed=100 + r)  # every rank starts elsewhere: the broadcast callback fixes that
    optimizer = hvd.DistributedOptimizer(make_opt())
    assert isinstance(optimizer, type(make_opt())) and isinstance(optimizer, DistributedOptimizerMixin)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    before, recorder = Before(), Recorder()
    model.fit(X[mine], Y[mine], batch_size=b, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), before,
                         hvd.callbacks.MetricAverageCallback()] + lr_callbacks(0.05) + [recorder])
    reference = make_model(seed=100)
    reference.compile(optimizer=make_opt(), loss="mse", metrics=["mae"])
    ref_recorder = Recorder()
    reference.fit(X[ORDER], Y[ORDER], batch_size=n * b, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=lr_callbacks(0.05) + [ref_recorder])
    name = type(optimizer).__name__
    check_close(model.get_weights(), reference.get_weights(), f"fit {name} equivalence")
    identical_everywhere(model.get_weights() + [v.numpy() for v in optimizer_variables(optimizer)], f"fit {name}")
    assert int(optimizer.iterations.numpy()) == EPOCHS * N // b
    # lr: warm-up from lr/size to lr over 2 epochs, then the schedule (x0.5 per epoch from epoch 2)
    steps = N // b
    expected_lr = [0.05 / n * ((e + (i + 1) / steps) * (n - 1) / 2 + 1) for e in range(2) for i in range(steps)]
    expected_lr += [0.05 * 0.5 ** (e - 2) for e in range(2, EPOCHS) for _ in range(steps)]
    check_close(np.array(recorder.lrs), np.array(expected_lr), f"{name} lr schedule", rtol=1e-6)
    assert recorder.epoch_logs[-1]["lr"] == recorder.lrs[-1]
    # averaged epoch metrics: equal on every rank, the mean of what each rank reported (its own shard)
    logs = hvd_tf.allgather_object(recorder.epoch_logs)
    assert all(entry == logs[0] for entry in logs), logs
    raw = hvd_tf.allgather_object(before.raw)
    assert n == 1 or len({entry["loss"] for entry in raw}) > 1, raw
    for key in ("loss", "mae"):
        assert np.isclose(recorder.epoch_logs[-1][key], np.mean([entry[key] for entry in raw])), (key, raw)


def test_momentum_correction_reproduces_keras2() -> None:
    """After lr a -> c, one step uses momentum * c / a."""
    w = variable([1.0])
    sgd = SGD(0.1, momentum=0.9)
    holder = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    holder.optimizer = sgd
    apply(sgd, [tf.constant([2.0])], [w])  # v = -0.2, w = 0.8
    schedule = hvd.callbacks.LearningRateScheduleCallback(0.1, multiplier=lambda epoch: 0.5)
    schedule.set_model(holder)
    schedule._adjust_learning_rate(0)  # lr 0.1 -> 0.05
    apply(sgd, [tf.constant([2.0])], [w])
    v_keras2 = (0.9 * 0.05 / 0.1) * -0.2 - 0.05 * 2.0
    check_close([w.numpy()], [np.array([0.8 + v_keras2], np.float32)], "momentum correction", rtol=1e-6)


# backward_passes_per_step: sum (or average) N local gradients, reduce and apply every N-th step
def accumulated_reference(average):
    reference, sgd, pending = make_model(seed=200), SGD(0.05), None
    for i, rows in enumerate([ORDER[i * n * b:(i + 1) * n * b] for i in range(N // b)] * 2):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(Y[rows], reference(X[rows]))
        grads = tape.gradient(loss, reference.trainable_variables)
        pending = grads if pending is None else [p + g for p, g in zip(pending, grads)]
        if i % 2 == 1:
            apply(sgd, [p / 2 if average else p for p in pending], reference.trainable_variables)
            pending = None
    return reference.get_weights()



def test_backward_passes_per_step_in_fit_sums() -> None:
    """In model.fit (inside tf.function): summed."""
    model = make_model(seed=200 + r)  # in model.fit (inside tf.function): summed
    optimizer = hvd.DistributedOptimizer(SGD(0.05), backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X[mine], Y[mine], batch_size=b, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    check_close(model.get_weights(), accumulated_reference(average=False), "backward_passes_per_step in fit")
    identical_everywhere(model.get_weights(), "backward_passes_per_step")
    assert int(optimizer.iterations.numpy()) == 2 * N // b


def test_average_aggregated_gradients_eagerly() -> None:
    """Eagerly, with optimizer.apply: averaged."""
    model = make_model(seed=200)  # eagerly, with optimizer.apply: averaged
    optimizer = hvd.DistributedOptimizer(SGD(0.05), backward_passes_per_step=2,
                                         average_aggregated_gradients=True)
    for i in range(2 * N // b):
        rows = ORDER[(i % (N // b)) * n * b:(i % (N // b) + 1) * n * b][r * b:(r + 1) * b]
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(Y[rows], model(X[rows]))
        apply(optimizer, tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    check_close(model.get_weights(), accumulated_reference(average=True), "average_aggregated_gradients, eager")
    assert int(optimizer.iterations.numpy()) == 2 * N // b


def test_an_inf_gradient_in_an_aggregated_step_reaches_every_rank() -> None:
    """backward_passes_per_step=2: rank 0's inf in the first pass survives the local sum and the allreduce,
    so every rank applies the same inf (no rank keeps finite weights, none hangs); the next window is clean."""
    w = variable([1.0, 1.0])
    optimizer = hvd.DistributedOptimizer(SGD(0.5), backward_passes_per_step=2, average_aggregated_gradients=True)
    first = [np.inf, 1.0] if r == 0 else [1.0, 1.0]
    apply(optimizer, [tf.constant(first)], [w])
    same(w.numpy(), np.array([1.0, 1.0], np.float32), "before the aggregated step")
    apply(optimizer, [tf.constant([1.0, 1.0])], [w])
    same(w.numpy(), np.array([-np.inf, 0.5], np.float32), "after the aggregated step")
    identical_everywhere([w.numpy()], "inf gradient")
    w.assign([1.0, 1.0])
    for _ in range(2):
        apply(optimizer, [tf.constant([2.0, float(r)])], [w])
    same(w.numpy(), np.array([0.0, 1.0 - 0.5 * (n - 1) / 2], np.float32), "the next window")
    assert int(optimizer.iterations.numpy()) == 4


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                             keras.layers.Flatten(), keras.layers.Dense(1)])



def test_sparse_gradients_in_fit() -> None:
    """Embedding: allgathered IndexedSlices, or dense with sparse_as_dense."""
    reference = embedding_model(300)
    reference.compile(optimizer=SGD(0.1), loss="mse")
    reference.fit(tokens[ORDER], targets[ORDER], batch_size=n * b, epochs=2, shuffle=False, verbose=0)
    for sparse_as_dense in (False, True):
        model = embedding_model(300 + r)
        model.compile(optimizer=hvd.DistributedOptimizer(SGD(0.1), sparse_as_dense=sparse_as_dense),
                      loss="mse")
        model.fit(tokens[mine], targets[mine], batch_size=b, epochs=2, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        check_close(model.get_weights(), reference.get_weights(), f"sparse fit sparse_as_dense={sparse_as_dense}")


def loop_step(net, opt, x, y, scale, call):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(net(x) - y)) * scale
    grads = tape.gradient(loss, net.trainable_variables)
    if call == "apply":
        apply(opt, grads, net.trainable_variables)
    else:
        opt.apply_gradients(zip(grads, net.trainable_variables))


def test_custom_loops_apply_and_apply_gradients_eager_and_in_tf_function() -> None:
    references = {}
    for op in (hvd.Average, hvd.Sum):
        reference, ref_opt = make_model(seed=400), keras.optimizers.Adam(0.01)
        for i in range(2):
            rows = ORDER[i * n * b:(i + 1) * n * b]
            loop_step(reference, ref_opt, X[rows], Y[rows], float(n) if op is hvd.Sum else 1.0, "apply")
        references[op] = reference.get_weights()
    for use_function, call, op in [(False, "apply", hvd.Average), (False, "apply_gradients", hvd.Sum),
                                    (True, "apply", hvd.Sum), (True, "apply_gradients", hvd.Average)]:
        model = make_model(seed=400)
        optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), op=op)
        optimizer.build(model.trainable_variables)  # else tf.function traces twice (variables on first call)
        step = tf.function(loop_step) if use_function else loop_step
        for i in range(2):
            rows = ORDER[i * n * b:(i + 1) * n * b][r * b:(r + 1) * b]
            step(model, optimizer, X[rows], Y[rows], 1.0, call)
        check_close(model.get_weights(), references[op], f"custom loop {call} tf.function={use_function} op={op}")


def test_process_set_members_average_the_others_keep_theirs() -> None:
    """Only the set's members average their gradients (fp16 on the wire); the others keep theirs."""
    members = [0, 2] if n >= 3 else [1]
    subset = hvd.add_process_set(members)
    v = variable([0.0])
    optimizer = hvd.DistributedOptimizer(SGD(1.0), process_set=subset, compression=hvd.Compression.fp16)
    apply(optimizer, [tf.constant([float(r)])], [v])
    check_close([v.numpy()], [np.array([-np.mean(members) if r in members else -float(r)], np.float32)],
                "DistributedOptimizer(process_set=...)", rtol=0, atol=0)
    assert hvd.remove_process_set(subset)
    if LEGACY:  # tf-keras: a caller that turns the optimizer's own aggregation off gets its gradients as given
        for plain, off in ((SGD(1.0), {"experimental_aggregate_gradients": False}),
                           (keras.optimizers.SGD(1.0), {"skip_gradients_aggregation": True})):
            w = variable([0.0])
            hvd.DistributedOptimizer(plain).apply_gradients([(tf.constant([float(r)]), w)], **off)
            same(w.numpy(), np.array([-float(r)], np.float32), f"{type(plain).__name__} {off}")


CONFIG_OPTIMIZERS = [lambda **kw: keras.optimizers.AdamW(0.003, weight_decay=0.01, **kw)]
if LEGACY:
    CONFIG_OPTIMIZERS.append(lambda **kw: keras.optimizers.legacy.Adam(0.003, beta_1=0.8, **kw))


def test_config_round_trip_and_argument_errors() -> None:
    for make in CONFIG_OPTIMIZERS:
        optimizer = hvd.DistributedOptimizer(make(), op=hvd.Sum, backward_passes_per_step=3,
                                             compression=hvd.Compression.fp16)
        config = optimizer.get_config()
        assert config == make(name=config["name"]).get_config()
        again = type(optimizer).from_config(config)
        assert isinstance(again, type(make())) and isinstance(again, DistributedOptimizerMixin)
        assert again.get_config() == config and again._hvd.settings == optimizer._hvd.settings
        plain = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        assert type(plain) is type(make()) and plain.get_config() == config
    via_tf = hvd_tf.DistributedOptimizer(SGD(0.1))
    assert isinstance(via_tf, DistributedOptimizerMixin) and isinstance(via_tf, SGD)
    with pytest.raises(ValueError, match="only supports hvd.Average, hvd.Sum and hvd.Adasum"):
        hvd.DistributedOptimizer(SGD(0.1), op=hvd_tf.Max)
    with pytest.raises(ValueError, match="keras.optimizers.Optimizer"):
        hvd_tf.DistributedOptimizer(object())


@keras.saving.register_keras_serializable(package="hvdtest")
class MySGD(keras.optimizers.SGD):
    pass


def test_saving_load_model_and_broadcast_global_variables(tmp_path: Path) -> None:
    """BestModelCheckpoint on rank 0 only (Keras 3); a .keras (Keras 3) or .h5 and SavedModel (tf-keras)
    round trip with hvd.load_model; a registered custom optimizer keeps its name through the wrapper (Keras 3);
    broadcast_global_variables reaches every live model."""
    gc.collect()  # models of earlier tests must not linger: broadcast_global_variables sees every live one
    tmp = hvd_tf.broadcast_object(str(tmp_path), root_rank=0)  # one directory for every rank
    model = make_model(seed=500 + r)
    make_opt = (lambda: keras.optimizers.legacy.Adam(lr=0.01)) if LEGACY else (lambda: keras.optimizers.Adam(0.01))
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    best = os.path.join(tmp, f"best_rank{r}.keras")
    if not LEGACY:  # BestModelCheckpoint is a Keras 3 ModelCheckpoint
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=best))
    model.fit(X[mine], Y[mine], batch_size=b, epochs=2, verbose=0, validation_data=(X[mine], Y[mine]),
              callbacks=callbacks)
    assert LEGACY or os.path.exists(best) == (r == 0), (r, os.listdir(tmp))
    del callbacks  # they hold the model, which broadcast_global_variables below must not find
    paths = [os.path.join(tmp, "model" + SUFFIX)] + ([os.path.join(tmp, "saved_model")] if LEGACY else [])
    if r == 0:
        for saved in paths:
            model.save(saved)
    hvd_tf.barrier()
    for saved in paths:
        loaded = hvd.load_model(saved)
        assert isinstance(loaded.optimizer, DistributedOptimizerMixin) and isinstance(loaded.optimizer,
                                                                                      type(make_opt()))
        restored = saved.endswith(SUFFIX)  # tf-keras restores no optimizer state from a SavedModel (plain neither)
        if restored:
            check_close([v.numpy() for v in optimizer_variables(loaded.optimizer)],
                        [v.numpy() for v in optimizer_variables(model.optimizer)], "load_model optimizer state",
                        rtol=0, atol=0)
        check_close(loaded.get_weights(), model.get_weights(), "load_model weights", rtol=0, atol=0)
        plain_loaded = keras.models.load_model(saved)
        assert type(plain_loaded.optimizer) is type(make_opt())
        del plain_loaded  # it has the name of `loaded`: broadcast_global_variables below would refuse twins
        loaded.fit(X[mine], Y[mine], batch_size=b, epochs=1, verbose=0,
                   callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        identical_everywhere(loaded.get_weights(), "after load_model and fit")
        assert int(loaded.optimizer.iterations.numpy()) == (3 if restored else 1) * N // b
        if saved != paths[-1]:
            del loaded
        gc.collect()
    if not LEGACY:
        custom = make_model(seed=550)
        custom.compile(optimizer=hvd.DistributedOptimizer(MySGD(0.1)), loss="mse")
        custom_path = os.path.join(tmp, f"custom_rank{r}.keras")
        custom.save(custom_path)
        assert type(keras.models.load_model(custom_path).optimizer) is MySGD
        custom = hvd.load_model(custom_path, custom_optimizers=[MySGD])
        assert isinstance(custom.optimizer, MySGD) and isinstance(custom.optimizer, DistributedOptimizerMixin)
        del custom

    # -- broadcast_global_variables: every live model, from root ---------------------------------------
    model = make_model(seed=600 + r)
    hvd.broadcast_global_variables(n - 1)
    root_weights = hvd_tf.broadcast_object(model.get_weights(), root_rank=n - 1)
    check_close(model.get_weights(), root_weights, "broadcast_global_variables", rtol=0, atol=0)
    identical_everywhere(loaded.get_weights() + [v.numpy() for v in optimizer_variables(loaded.optimizer)],
                         "global variables")
    if r == 0 and not LEGACY:
        assert sorted(p.name for p in Path(tmp).glob("best_rank*.keras")) == ["best_rank0.keras"]


def test_value_functions_and_the_hvdlite_keras_alias() -> None:
    assert hvd_alias.DistributedOptimizer is hvd.DistributedOptimizer and hvd_alias.callbacks is hvd.callbacks
    import hvdlite.keras.callbacks as alias_callbacks  # noqa: E402
    assert alias_callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback
    same(hvd_alias.allreduce([float(r)], op=hvd.Sum).numpy(), np.array([n * (n - 1) / 2], np.float32), "allreduce")
    same(hvd.allreduce(float(r)).numpy(), np.float32((n - 1) / 2), "allreduce average")
    same(hvd.allgather([r]).numpy(), np.arange(n, dtype=np.int32), "allgather")
    same(hvd.broadcast(r, root_rank=n - 1).numpy(), np.int32(n - 1), "broadcast")
    same(hvd.reducescatter(np.ones((n, 2), np.float32) * r).numpy(), np.full((1, 2), (n - 1) / 2, np.float32),
         "reducescatter")


def test_jit_compile_cannot_reduce_gradients_and_the_error_names_the_fix() -> None:
    model = make_model(seed=700)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    with pytest.raises(hvd_tf.XLANotSupportedError, match="jit_compile=False"):
        model.fit(X[mine], Y[mine], batch_size=b, epochs=1, verbose=0)


def test_check_replicas_callback_passes_equal_replicas_and_names_a_perturbed_kernel() -> None:
    """hvd.callbacks.CheckReplicasCallback in model.fit under either Keras: equal replicas pass after every batch;
    a kernel perturbed on the last rank is named on every rank, with its difference."""
    model = make_model(100 + r)  # different on every rank until the broadcast
    model.compile(optimizer=hvd.DistributedOptimizer(SGD(0.05, momentum=0.9)), loss="mse")
    every_batch = hvd.callbacks.CheckReplicasCallback(every_n_batches=1)
    model.fit(X[mine], Y[mine], batch_size=b, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), every_batch,
                         hvd.callbacks.CheckReplicasCallback()])
    assert every_batch._batches == 2 * N // b
    kernel = model.layers[-1].kernel
    if r == n - 1:
        kernel.assign_add(np.eye(5, 2, dtype=np.float32) * 0.5)
    with pytest.raises(hvd.ReplicaDivergenceError) as info:
        model.fit(X[mine], Y[mine], batch_size=b, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.CheckReplicasCallback(every_n_batches=1)])
    assert info.value.ranks == (n - 1,) and "kernel" in info.value.tensor, str(info.value)
    assert info.value.max_abs_diff == pytest.approx(0.5, abs=1e-4), str(info.value)
    assert len(set(hvd_tf.allgather_object(str(info.value)))) == 1
