"""Data-parallel Keras 2 (tf-keras) training on scikit-learn's digits with hvdlite, written as a Horovod 0.28
Keras script was (``lr=``, a ``tf.keras.optimizers.legacy`` optimizer, an ``.h5`` checkpoint on rank 0).

Keras 2 on TensorFlow 2.16 and later is the tf-keras package, chosen by ``TF_USE_LEGACY_KERAS=1`` before
TensorFlow is imported (``pip install tf-keras``; this script sets the variable itself if it is unset).
Launch with any number of processes (1 works too):

    TF_USE_LEGACY_KERAS=1 mpiexec -n 2 python examples/keras2_digits.py

It prints ``test_accuracy=0.97...`` on rank 0 at the end and rank 0 writes ``digits_keras2.h5`` (the model
with its optimizer, after every epoch) in ``--checkpoint-dir``. A Horovod script needs only its import
changed: ``import horovod.tensorflow.keras as hvd`` becomes ``import hvdlite.tensorflow.keras as hvd``.
"""
import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf-keras (Keras 2): before TensorFlow's import

import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdlite.tensorflow.keras as hvd  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=16)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one process; scaled by size")
parser.add_argument("--warmup-epochs", type=int, default=3)
parser.add_argument("--checkpoint-dir", default="checkpoints")
args = parser.parse_args()

hvd.init()
# One GPU per rank, picked by the rank's index on its node (Horovod's recipe; without GPUs this does nothing).
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
tf.keras.utils.set_random_seed(1234 + hvd.rank())  # ranks start from different weights: the broadcast aligns them

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
usable = len(x_train) // hvd.size() * hvd.size()  # equal shards: every rank runs the same number of steps
x_shard, y_shard = x_train[:usable][hvd.rank()::hvd.size()], y_train[:usable][hvd.rank()::hvd.size()]

model = tf.keras.models.Sequential([
    tf.keras.layers.Dense(128, activation="relu", input_shape=(64,)),
    tf.keras.layers.Dropout(0.1),
    tf.keras.layers.Dense(10, activation="softmax"),
])

# Horovod's Keras 2 recipe: scale the learning rate by the number of ranks, wrap the optimizer, warm up.
scaled_lr = args.lr * hvd.size()
opt = tf.keras.optimizers.legacy.SGD(lr=scaled_lr, momentum=0.9)
opt = hvd.DistributedOptimizer(opt)
model.compile(loss=tf.keras.losses.sparse_categorical_crossentropy, optimizer=opt, metrics=["accuracy"],
              experimental_run_tf_function=False)

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.5, start_epoch=10),
]
if hvd.rank() == 0:  # only rank 0 writes checkpoints, so the others cannot corrupt them
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "digits_keras2.h5")))

model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
          verbose=2 if hvd.rank() == 0 else 0)

# Every rank holds the same weights; rank 0 reports the accuracy on the whole test set, and checks that the
# checkpoint loads back (as hvd.load_model does when training resumes) with the same accuracy.
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
if hvd.rank() == 0:
    restored = hvd.load_model(os.path.join(args.checkpoint_dir, "digits_keras2.h5"))
    _, restored_accuracy = restored.evaluate(x_test, y_test, verbose=0)
    print(f"test_loss={loss:.4f}")
    print(f"test_accuracy={accuracy:.4f}")
    print(f"restored_accuracy={restored_accuracy:.4f}")
