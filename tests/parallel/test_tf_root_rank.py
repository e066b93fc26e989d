"""root_rank is a rank of the whole job in hvdlite.tensorflow too (Horovod's meaning): every rooted op, eagerly
and in tf.function, over the set of every rank but 0 ([1, 2] at -n 3, [1, 2, 3] at -n 4), every root; a root
outside the set fails with the same error on every member; BroadcastGlobalVariablesCallback from every rank."""
from __future__ import annotations

import os
import re
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import root_sets  # noqa: E402
from exact import same  # noqa: E402
from root_sets import MEMBERS  # noqa: E402

MPI_SIZES = (3, 4)
SPAWN_TIMEOUT = 300
tf.get_logger().setLevel("ERROR")
R, N = hvd.rank(), hvd.size()
MODES = {"eager": lambda f: f, "graph": tf.function}


def value(rank: int) -> np.ndarray:
    return root_sets.value(rank, np.float32)


def rooted(ps: Any) -> dict[str, Callable[[int], Any]]:
    """Each rooted function: root -> this rank's result (an array)."""
    def in_place(root: int) -> np.ndarray:
        v = tf.Variable(value(R))
        hvd.broadcast_([v], root, process_set=ps)
        return v.numpy()

    def variables(root: int) -> np.ndarray:
        v, w = tf.Variable(value(R)), tf.Variable(np.float64(R))
        hvd.broadcast_variables([v, w], root, process_set=ps)
        same(w.numpy(), np.float64(root), "broadcast_variables scalar")
        return v.numpy()

    def graph_variables(root: int) -> np.ndarray:
        v = tf.Variable(value(R))
        @tf.function
        def run() -> None:
            hvd.broadcast_variables([v], root, process_set=ps)
        run()
        return v.numpy()

    def gradient(root: int) -> np.ndarray:
        x = tf.constant(value(R))
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = hvd.broadcast(x, root, process_set=ps)
            loss = tf.reduce_sum(out * float(R + 1))
        want = np.full((2, 3), np.mean([r + 1 for r in MEMBERS]), np.float32) if R == root else \
            np.zeros((2, 3), np.float32)
        same(tape.gradient(loss, x).numpy(), want, "broadcast gradient")
        return out.numpy()

    fns: dict[str, Callable[[int], Any]] = {}
    for mode, wrap in MODES.items():
        fns[f"broadcast ({mode})"] = lambda root, wrap=wrap: wrap(
            lambda: hvd.broadcast(tf.constant(value(R)), root, process_set=ps))().numpy()
    fns.update({"broadcast_": in_place, "broadcast_variables": variables,
                "broadcast_variables (graph)": graph_variables, "broadcast (gradient)": gradient,
                "broadcast_object": lambda root: hvd.broadcast_object({"v": value(R)}, root, process_set=ps)["v"]})
    return fns


def test_every_rooted_op_broadcasts_from_the_job_rank(ps: Any) -> None:
    if R not in MEMBERS:
        return
    for name, fn in rooted(ps).items():
        for root in MEMBERS:
            same(np.asarray(fn(root)), value(root), f"{name} root_rank={root} over {MEMBERS}")


def test_a_root_outside_the_set_fails_on_every_member(ps: Any) -> None:
    if R not in MEMBERS:
        return
    for root in (0, N):
        for name, fn in rooted(ps).items():
            # Horovod's type: tf.errors.InvalidArgumentError (eagerly also a ValueError, as in hvdlite's core)
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as info:
                fn(root)
            assert re.search(rf"\b{root}\).* the set's ranks are {re.escape(str(MEMBERS))}", str(info.value)), \
                f"{name}: {info.value}"
            if name != "broadcast_object":  # an op's error; broadcast_object's is the core's ValueError
                assert isinstance(info.value, tf.errors.InvalidArgumentError), f"{name}: {type(info.value)}"
    same(hvd.broadcast(tf.constant(value(R)), MEMBERS[0], process_set=ps).numpy(), value(MEMBERS[0]), "after")


def test_broadcast_global_variables_callback_from_every_rank() -> None:
    import keras

    import hvdlite.tensorflow.keras as hvdk
    for root in range(N):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for v in model.weights:
            v.assign(np.full(v.shape, float(R), np.float32))
        x = np.ones((4, 3), np.float32) * 0  # zero inputs and targets: the step leaves the kernel alone
        model.fit(x, np.zeros((4, 2), np.float32), batch_size=4, epochs=1, verbose=0,
                  callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(root)])
        same(model.weights[0].numpy(), np.full((3, 2), float(root), np.float32), f"callback root {root}")
