"""Data-parallel TensorFlow 2 custom training loop on scikit-learn's digits with hvdlite.DistributedGradientTape.

The same task as keras_digits.py, written as a tf.function training step: each rank computes gradients on
its shard, ``hvd.DistributedGradientTape`` averages them over all ranks. Launch with any number of
processes (1 works too):

    mpiexec -n 2 python examples/tensorflow2_digits.py

(``TF_CPP_MIN_LOG_LEVEL=2`` in the environment quiets TensorFlow's start-up messages.)

It prints ``test_accuracy=0.97...`` on rank 0 at the end; rank 0 also saves the weights to
``--checkpoint-dir``. A Horovod script needs only its import changed:
``import horovod.tensorflow as hvd`` becomes ``import hvdlite.tensorflow as hvd``.
"""
import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdlite.tensorflow as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=16)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.002, help="learning rate of one process; scaled by size")
parser.add_argument("--checkpoint-dir", default="checkpoints")
args = parser.parse_args()

hvd.init()
# One GPU per rank, picked by the rank's index on its node (Horovod's recipe; without GPUs this does nothing).
gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
keras.utils.set_random_seed(1234 + hvd.rank())  # ranks start from different weights: the broadcast aligns them

# Data: the same split on every rank, then each rank keeps every size()-th training example.
digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
usable = len(x_train) // hvd.size() * hvd.size()  # equal shards: every rank runs the same number of steps
x_shard, y_shard = x_train[:usable][hvd.rank()::hvd.size()], y_train[:usable][hvd.rank()::hvd.size()]
dataset = tf.data.Dataset.from_tensor_slices((x_shard, y_shard))

model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10),
])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(args.lr * hvd.size())  # Horovod's recipe: scale the rate by the ranks

# Start every rank from rank 0's weights and optimizer state.
optimizer.build(model.trainable_variables)
hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)


@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)  # tape.gradient() now averages over all ranks
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for epoch in range(args.epochs):
    losses = [train_step(images, labels) for images, labels in
              dataset.shuffle(len(x_shard), seed=epoch).batch(args.batch_size)]
    epoch_loss = hvd.allreduce(tf.reduce_mean(losses))  # average of every rank's mean loss
    if hvd.rank() == 0:
        print(f"epoch {epoch + 1}/{args.epochs}: loss={float(epoch_loss):.4f}", flush=True)

if hvd.rank() == 0:  # weights are identical everywhere: one rank writes them
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    model.save_weights(os.path.join(args.checkpoint_dir, "digits_tf2.weights.h5"))

logits = model(x_test, training=False)
accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
if hvd.rank() == 0:
    print(f"test_accuracy={accuracy:.4f}")
