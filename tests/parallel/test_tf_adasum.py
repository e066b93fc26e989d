"""hvd.Adasum in hvdlite.tensorflow and hvdlite.tensorflow.keras: allreduce / grouped_allreduce (eager and
tf.function) equal a numpy reference of the tree, DistributedGradientTape combines gradients with it,
a Keras DistributedOptimizer(op=hvd.Adasum) trains the digits to >= 90% with identical weights everywhere,
sparse gradients are refused, and 3 ranks get the clear power-of-two error."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import hvdlite.tensorflow as hvd
import hvdlite.tensorflow.keras as hvdk
from adasum_reference import reference

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 400
POW2 = pytest.mark.mpi(sizes=(2, 4))


def per_rank(size: int, shape: tuple, seed: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(size)]


def expected(vectors: list[np.ndarray]) -> np.ndarray:
    return reference([v.reshape(-1) for v in vectors]).reshape(vectors[0].shape)


@POW2
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_allreduce_matches_reference_eager_and_graph(rank: int, size: int, dtype, rtol: float) -> None:
    vectors = per_rank(size, (5, 7), seed=3, dtype=dtype)
    eager = hvd.allreduce(tf.constant(vectors[rank]), op=hvd.Adasum, name=f"tf.adasum.{np.dtype(dtype).name}")
    assert eager.dtype == tf.as_dtype(dtype) and eager.shape == (5, 7)
    np.testing.assert_allclose(eager.numpy(), expected(vectors), rtol=rtol, atol=rtol)

    @tf.function
    def graph(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Adasum)
    np.testing.assert_allclose(graph(tf.constant(vectors[rank])).numpy(), expected(vectors), rtol=rtol, atol=rtol)


@POW2
def test_grouped_allreduce_treats_each_tensor_as_its_own_vector(rank: int, size: int) -> None:
    first, second = per_rank(size, (4,), seed=5), per_rank(size, (3, 2), seed=6)
    out = hvd.grouped_allreduce([tf.constant(first[rank]), tf.constant(second[rank])], op=hvd.Adasum)
    np.testing.assert_allclose(out[0].numpy(), expected(first), rtol=1e-12)
    np.testing.assert_allclose(out[1].numpy(), expected(second), rtol=1e-12)


@POW2
def test_gradient_tape_combines_gradients_with_adasum(rank: int, size: int) -> None:
    w = tf.Variable(np.zeros(6), name="adasum_w")
    coefficients = per_rank(size, (6,), seed=9)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * tf.constant(coefficients[rank]))
    tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
    (grad,) = tape.gradient(loss, [w])
    np.testing.assert_allclose(grad.numpy(), reference(coefficients), rtol=1e-12)
    identical = tf.constant([1.0, -2.0, 3.0])
    np.testing.assert_allclose(hvd.allreduce(identical, op=hvd.Adasum).numpy(), [1.0, -2.0, 3.0], rtol=1e-6)


@POW2
def test_sparse_gradients_are_refused_with_adasum() -> None:
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), dense_shape=tf.constant([3, 2]))
    with pytest.raises(NotImplementedError, match="hvd.Adasum does not support sparse tensors; pass "
                                                  "sparse_as_dense=True"):
        hvd.allreduce(slices, op=hvd.Adasum)


@POW2
def test_keras_digits_train_with_adasum(rank: int, size: int) -> None:
    import keras
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    keras.utils.set_random_seed(100 + rank)  # different starting weights: the callback aligns them
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    opt = hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01), op=hvd.Adasum)  # no LR scaling with Adasum
    assert opt._hvd.settings["op"] is hvd.Adasum
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train[rank::size], y_train[rank::size], batch_size=16, epochs=8, verbose=0, shuffle=False,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy >= 0.9, accuracy
    everyone = hvd.allgather_object([w.numpy() for w in model.weights])
    for other in everyone[1:]:
        for mine, theirs in zip(everyone[0], other):
            np.testing.assert_array_equal(mine, theirs)


@pytest.mark.mpi(sizes=(3,))
def test_three_ranks_get_the_power_of_two_error() -> None:
    with pytest.raises(ValueError, match=r"hvd.Adasum needs a power-of-two number of ranks in the process set "
                                         r"\(got 3\)"):
        hvd.allreduce(tf.ones([3], tf.float64), op=hvd.Adasum, name="tf.three")
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    with pytest.raises(ValueError, match="power-of-two"):
        hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w])
