"""Keras fit with hvd.elastic.KerasState and the elastic callbacks on digits (tests/test_elastic.py); Keras 3,
or tf-keras (Keras 2) when TF_USE_LEGACY_KERAS=1.

Rank 0 prints ``epoch=E size=S`` after each epoch, ``reset: size=S`` after a restart and
``test_accuracy=<float>`` at the end (tests/test_elastic_inprocess.py reads them). Every rank also reports
(tests/workers/report.py) ``progress`` after each epoch (``epoch``, ``size``, ``commit``) and, at the end,
``final``: the epoch and size, the test accuracy, a hash of the weights, and ``resets``: the size and learning
rate each run of the reset callback in this process set."""
import argparse
import hashlib
import os
import time

import numpy as np
from report import report
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hvdlite.keras as hvd

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as keras
else:
    import keras

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()
LR, BATCH = 0.02, 16

hvd.init()
keras.utils.set_random_seed(7)
digits = load_digits()
x = (digits.data / 16.0).astype("float32")
x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=357, random_state=7,
                                                    stratify=digits.target)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR * hvd.size(), momentum=0.9))
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer,
              metrics=["accuracy"])
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
resets = []


def learning_rate():
    return float(np.asarray(model.optimizer.learning_rate))


def on_reset():
    model.optimizer.learning_rate = LR * hvd.size()
    resets.append({"size": hvd.size(), "lr": learning_rate()})
    if hvd.rank() == 0:
        print(f"reset: size={hvd.size()}", flush=True)


state.register_reset_callbacks([on_reset])


class Progress(keras.callbacks.Callback):
    def on_batch_end(self, batch, logs=None):
        time.sleep(args.sleep)

    def on_epoch_end(self, epoch, logs=None):
        report(hvd.rank(), progress={"epoch": state.epoch, "size": hvd.size(), "commit": state.commit_counter})
        if hvd.rank() == 0:
            print(f"epoch={state.epoch} size={hvd.size()} commit={state.commit_counter}", flush=True)


@hvd.elastic.run
def train(state):
    mine = slice(hvd.rank(), None, hvd.size())
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=5), Progress()]
    model.fit(x_train[mine], y_train[mine], batch_size=BATCH, epochs=args.epochs - state.epoch, shuffle=True,
              callbacks=callbacks, verbose=0)


train(state)
_, accuracy = model.evaluate(x_test, y_test, verbose=0)
weights = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()[:16]
report(hvd.rank(), final={"epoch": state.epoch, "size": hvd.size(), "accuracy": float(accuracy), "sha": weights,
                          "resets": resets})
if hvd.rank() == 0:
    print(f"final_epoch={state.epoch}", flush=True)
    print(f"test_accuracy={accuracy:.4f}", flush=True)
hvd.shutdown()
