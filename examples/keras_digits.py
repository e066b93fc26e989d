"""Data-parallel Keras 3 training on scikit-learn's digits with hvdlite (Horovod's Keras API).

Each rank trains on its own shard of the training set; hvdlite averages the gradients, so all ranks keep
identical weights. Launch with any number of processes (1 works too):

    mpiexec -n 2 python examples/keras_digits.py
    mpiexec -n 2 python examples/keras_digits.py --use-adasum   # Adasum: needs 1, 2, 4, 8... processes

(``TF_CPP_MIN_LOG_LEVEL=2`` in the environment quiets TensorFlow's start-up messages.)

It prints ``test_accuracy=0.97...`` on rank 0 at the end and keeps the best model (by validation loss)
in ``--checkpoint-dir`` (rank 0 writes it). A Horovod script needs only its import changed:
``import horovod.tensorflow.keras as hvd`` becomes ``import hvdlite.tensorflow.keras as hvd``.
"""
import argparse
import os

import keras
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdlite.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=16)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--lr", type=float, default=0.002, help="learning rate of one process; scaled by size")
parser.add_argument("--warmup-epochs", type=int, default=3)
parser.add_argument("--checkpoint-dir", default="checkpoints")
parser.add_argument("--use-adasum", action="store_true",
                    help="combine gradients with hvd.Adasum instead of averaging (power-of-two process counts)")
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
x_val, y_val = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.1),
    keras.layers.Dense(10, activation="softmax"),
])

# Horovod's recipe: scale the learning rate by the number of ranks, warm it up, wrap the optimizer.
# With Adasum the learning rate is not scaled (Horovod's examples: lr_scaler = 1 on CPU).
scaled_lr = args.lr * (1 if args.use_adasum else hvd.size())
optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr),
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # everyone starts from rank 0's weights
    hvd.callbacks.MetricAverageCallback(),  # epoch metrics averaged over ranks (before the checkpoint reads them)
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs, verbose=1),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.5, start_epoch=10),
    hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=os.path.join(args.checkpoint_dir,
                                                                                 "digits.keras")),
]

model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, validation_data=(x_val, y_val),
          callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)  # one line per epoch, rank 0

# Every rank holds the same weights; rank 0 reports the accuracy on the whole test set.
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
if hvd.rank() == 0:
    print(f"test_loss={loss:.4f}")
    print(f"test_accuracy={accuracy:.4f}")
