"""Keras training samples/s: model.fit alone, on every rank alone, and with hvdlite's DistributedOptimizer.

Run:   mpiexec -n 2 python benchmarks/lab/keras_throughput.py [--tiny] (train_throughput.py's flags and records)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402
from train_throughput import default_batch, default_threads, parse_args, run_rounds, summarize  # noqa: E402


def keras_worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = default_threads(args, size)
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import numpy as np
    import hvdlite.tensorflow.keras as hvd
    BatchTimer = _batch_timer_class()
    hvd.init(**_common.parse_settings(args.hvd_setting))
    output = _common.Output(rank, args.out)
    output.emit(_common.machine_info("train_throughput", size, framework="keras", keras=keras.__version__,
                                     tensorflow=tf.__version__, threads_per_rank=threads, steps=args.steps,
                                     rounds=args.rounds, warmup=args.warmup, tiny=args.tiny))
    for model_name in [m for m in args.models.split(",") if m]:
        batch = default_batch(args, model_name)
        rng = np.random.default_rng(1234 + rank)
        if model_name == "resnet50":
            res = 32 if args.tiny else args.image_size
            x = rng.standard_normal((batch, res, res, 3), dtype=np.float32)

            def build() -> Any:
                keras.utils.set_random_seed(0)
                if args.tiny:
                    return keras.Sequential([keras.Input((res, res, 3)), keras.layers.Conv2D(4, 3),
                                             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
                return keras.applications.ResNet50(weights=None, input_shape=(res, res, 3), classes=10)
        elif model_name == "transformer":
            seq = 8 if args.tiny else args.seq_len
            vocab = 500 if args.tiny else 16000
            x = rng.integers(0, vocab, (batch, seq)).astype(np.int32)

            def build() -> Any:
                keras.utils.set_random_seed(0)
                return keras_transformer(keras, vocab, seq, *((32, 1, 2, 64) if args.tiny else (256, 4, 4, 1024)))
        else:
            raise SystemExit(f"unknown model {model_name!r}")
        y = rng.integers(0, 10, (batch,)).astype(np.int32)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        single_model = build()
        single_model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        hvd_model = build()
        hvd_model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                          loss=loss)
        # One batch per step: the same batch repeated, like Horovod's synthetic benchmark.
        xs = np.concatenate([x] * max(args.steps, args.warmup, 1))
        ys = np.concatenate([y] * max(args.steps, args.warmup, 1))
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]

        def fit(model: Any, steps: int, cbs: list[Any]) -> Callable[[], float]:
            def run() -> float:
                timer = BatchTimer()
                model.fit(xs[:steps * batch], ys[:steps * batch], batch_size=batch, epochs=1, verbose=0,
                          shuffle=False, callbacks=cbs + [timer])
                return timer.end - timer.start
            return run
        fit(hvd_model, 1, callbacks)()  # broadcast the initial weights
        methods = {"single": (fit(single_model, args.steps, []), True),
                   "independent": (fit(single_model, args.steps, []), False),  # every rank, no communication
                   "hvdlite": (fit(hvd_model, args.steps, []), False)}
        warm = {"single": (fit(single_model, args.warmup, []), True),
                "independent": (fit(single_model, args.warmup, []), False),
                "hvdlite": (fit(hvd_model, args.warmup, []), False)}
        run_rounds(comm, warm, argparse.Namespace(warmup=0, rounds=1, steps=1))
        times = run_rounds(comm, methods, argparse.Namespace(warmup=0, rounds=args.rounds, steps=1))
        extra = {"parameters": int(single_model.count_params()), "threads_per_rank": threads}
        for record in summarize("keras", model_name, batch, size, times, args.steps, {"single"}, extra):
            output.emit(record)
    output.emit({"bench": "train_throughput", "framework": "keras", "kind": "done"})
    output.close()
    hvd.shutdown()


def _batch_timer_class() -> type:
    import keras

    class BatchTimer(keras.callbacks.Callback):
        """Seconds from the first batch's start to the last batch's end (no fit() set-up or tear-down)."""

        def __init__(self) -> None:
            super().__init__()
            self.start = 0.0
            self.end = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if not self.start:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.end = time.perf_counter()
    return BatchTimer


def keras_transformer(keras: Any, vocab: int, seq: int, hidden: int, layers: int, heads: int,
                      intermediate: int) -> Any:
    """A BERT-style encoder classifier in Keras layers, the same shape as shapes.small_transformer."""
    class AddPositions(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.table = self.add_weight(shape=(seq, hidden), initializer="random_normal", name="positions")

        def call(self, x: Any) -> Any:
            return x + self.table[None]

    ids = keras.Input((seq,), dtype="int32")
    h = AddPositions()(keras.layers.Embedding(vocab, hidden)(ids))
    h = keras.layers.LayerNormalization(epsilon=1e-12)(h)
    for _ in range(layers):
        attn = keras.layers.MultiHeadAttention(heads, hidden // heads)(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + attn)
        ff = keras.layers.Dense(hidden)(keras.layers.Dense(intermediate, activation="gelu")(h))
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + ff)
    pooled = keras.layers.Dense(hidden, activation="tanh")(h[:, 0])
    return keras.Model(ids, keras.layers.Dense(10)(pooled))


if __name__ == "__main__":
    keras_worker(parse_args())
