"""Where Keras' gradient reduction time goes: ResNet-50's Keras gradients, each method timed interleaved.

Run: mpiexec -n 2 python benchmarks/lab/keras_reduce.py [--rounds 8] [--methods graph_fresh,graph,...] [--fit]

Methods (Average over all ranks of the 214 gradients of keras.applications.ResNet50 at 64x64, 94 MB):
  graph_fresh tf.function reduction into fresh arrays (emulated by patching; before issue 12's Keras work the
              status op also passed every tensor through its Python kernel: that path is gone)
  graph       today's path: as graph_fresh, outputs in buffers reused across steps
  eager       reduce_gradients eagerly
  core_oop    hvdlite.core grouped_allreduce on numpy arrays, fresh outputs
  core_inplace hvdlite.core grouped_allreduce_ on numpy arrays, in place
  raw         mpi4py Allreduce in place on one flat buffer in 1 MiB chunks (the transport's limit)
  handoff     tf.function: the 214 tensors to numpy and back through one numpy_function that reduces nothing
              (outputs from reused buffers, as today's path): TensorFlow's share of the graph path
  concat_split tf.function: the 214 tensors concatenated into one flat tensor and split back to their shapes,
              nothing reduced: what a flat-bucket path would add (TensorFlow makes each gradient a tensor of
              its own, so a bucket costs a copy in and a copy out)
  core_flat   hvdlite.core allreduce_ of one flat numpy buffer of all the gradients, in place: the engine's
              time for a flat bucket (concat_split + core_flat + a one-tensor handoff: a flat-bucket path)
--fit: also time model.fit steps (batch 16 per rank) of the same model with graph_fresh's and today's path.
Rank 0 prints the median per method and its ratio to the first method.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--methods", default="graph_fresh,graph,eager,core_oop,core_inplace,raw,"
                        "handoff,concat_split,core_flat")
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(max(1, (os.cpu_count() or 2) // 2))
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from mpi4py import MPI
    import hvdlite as core
    import hvdlite.tensorflow.keras as hvd
    from hvdlite.tensorflow import mpi_ops
    from hvdlite.tensorflow.reduction import reduce_gradients
    hvd.init()
    comm = MPI.COMM_WORLD

    @contextmanager
    def old_path() -> Iterator[None]:
        """Trace with the earlier behaviour: fresh outputs."""
        saved = mpi_ops.ReusableOutputs
        mpi_ops.ReusableOutputs = lambda: None
        try:
            yield
        finally:
            mpi_ops.ReusableOutputs = saved

    def build() -> Any:
        keras.utils.set_random_seed(0)
        return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10,
                                          classifier_activation=None)

    model = build()
    names = [v.path for v in model.trainable_variables]
    rng = np.random.default_rng(comm.rank)
    arrays = [rng.standard_normal(tuple(v.shape), dtype=np.float32) for v in model.trainable_variables]
    grads = [tf.constant(a) for a in arrays]
    if comm.rank == 0:
        print(f"{len(arrays)} gradients, {sum(a.nbytes for a in arrays) / 1e6:.1f} MB, {comm.size} ranks",
              flush=True)

    def traced(old: bool) -> Callable[[], Any]:
        fn = tf.function(lambda gs: [tf.reduce_sum(g[..., :1]) for g in reduce_gradients(gs, names=names)[:3]])

        def run() -> Any:
            if not old:
                return fn(grads)
            with old_path():  # only the first call traces; patching every call keeps it simple
                return fn(grads)
        return run

    outputs = [a.copy() for a in arrays]
    flat = np.concatenate([a.reshape(-1) for a in arrays])

    def raw() -> None:
        step = (1 << 20) // 4
        for s in range(0, flat.size, step):
            comm.Allreduce(MPI.IN_PLACE, flat[s:s + step], MPI.SUM)

    from hvdlite.tensorflow.buffers import ReusableOutputs
    pool = ReusableOutputs()
    dtypes = [g.dtype for g in grads]
    handoff = tf.function(lambda gs: [tf.reduce_sum(g[..., :1]) for g in tf.numpy_function(
        lambda *a: pool.like(a), gs, dtypes, stateful=True)[:3]])
    shapes = [g.shape for g in grads]
    sizes = [int(np.prod(s)) for s in shapes]
    concat_split = tf.function(lambda gs: [tf.reduce_sum(g[..., :1]) for g in [
        tf.reshape(p, s) for p, s in zip(tf.split(tf.concat([tf.reshape(g, [-1]) for g in gs], 0), sizes),
                                         shapes)][:3]])
    bucket = flat.copy()

    methods: Dict[str, Callable[[], Any]] = {
        "graph_fresh": traced(True), "graph": traced(False),
        "eager": lambda: reduce_gradients(grads, names=names),
        "core_oop": lambda: core.grouped_allreduce(arrays, op=core.Average, name="oop"),
        "core_inplace": lambda: core.grouped_allreduce_(outputs, op=core.Average, name="inplace"),
        "raw": raw, "handoff": lambda: handoff(grads), "concat_split": lambda: concat_split(grads),
        "core_flat": lambda: core.allreduce_(bucket, op=core.Average, name="flat")}
    timed = {m: methods[m] for m in args.methods.split(",") if m}
    report(comm, timed, args.rounds, "reduce")
    if args.fit:
        fit_steps(comm, hvd, keras, np, build, old_path, args.rounds)


def report(comm: Any, methods: Dict[str, Callable[[], Any]], rounds: int, what: str) -> None:
    """Warm each method up twice, time ``rounds`` interleaved rounds, print medians on rank 0."""
    times: Dict[str, list] = {m: [] for m in methods}
    for fn in methods.values():
        fn()
        fn()
    for _ in range(rounds):
        for m, fn in methods.items():
            comm.Barrier()
            start = time.perf_counter()
            fn()
            comm.Barrier()
            times[m].append(time.perf_counter() - start)
    if comm.rank == 0:
        first = statistics.median(next(iter(times.values())))
        for m, t in times.items():
            med = statistics.median(t)
            print(f"{what} {m:13s} median {med * 1e3:8.1f} ms  min {min(t) * 1e3:8.1f}  x{med / first:.2f}",
                  flush=True)
        print(f"load average {os.getloadavg()}", flush=True)


def fit_steps(comm: Any, hvd: Any, keras: Any, np: Any, build: Callable[[], Any], old_path: Any,
              rounds: int) -> None:
    """model.fit of 2 steps per call (batch 16 per rank), the old reduction path against today's."""
    rng = np.random.default_rng(1234 + comm.rank)
    x = rng.standard_normal((32, 64, 64, 3), dtype=np.float32)
    y = rng.integers(0, 10, (32,)).astype(np.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    models = {}
    for label in ("fit_old", "fit"):
        model = build()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), loss=loss)
        models[label] = model

    def fit(label: str) -> Callable[[], Any]:
        def run() -> Any:
            if label == "fit_old":
                with old_path():
                    return models[label].fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
            return models[label].fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        return run
    report(comm, {label: fit(label) for label in models}, rounds, "fit (2 steps)")


if __name__ == "__main__":
    main()
