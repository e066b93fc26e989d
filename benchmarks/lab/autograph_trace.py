"""A Keras custom loop's first call (AutoGraph's conversion, the trace, one step) with hvdlite's wrappers and without.

Run:   python benchmarks/lab/autograph_trace.py [--rounds 5] [--out benchmarks/results/autograph_trace.json]
Smoke: python benchmarks/lab/autograph_trace.py --rounds 1 --steps 2

Each measurement is a fresh process (``--child METHOD``: one rank, hvd.init() on a singleton MPI), so every
first call pays AutoGraph and tracing from cold; the methods alternate round by round. The step is a
``tf.function`` custom loop on a small Keras MLP (digits' shapes: 64 inputs, 10 classes, batch 32):
  plain              tf.GradientTape and the Keras optimizer: no hvdlite (the reference)
  tape               hvdlite.tensorflow's DistributedGradientTape around the tape (Horovod's custom-loop idiom)
  optimizer          hvdlite.tensorflow.keras' DistributedOptimizer(...).apply(grads, variables) (Keras 3)
  tape_converted     as tape, with AutoGraph converting hvdlite's functions (hvdlite's DoNotConvert rule
                     removed from AutoGraph's rule table: what every first trace did before session 15)
  optimizer_converted  as optimizer, converted likewise
One JSON line per method: the first call's seconds (median over rounds), a later call's (steady; median of
--steps calls after the first), ``first_over_plain`` and ``added_s`` (first call minus plain's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common  # noqa: E402

METHODS = ("plain", "tape", "optimizer", "tape_converted", "optimizer_converted")


def child(method: str, steps: int) -> dict[str, Any]:
    """One fresh process: build the model, time the step's first call and ``steps`` later ones."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    import keras
    import hvdlite.tensorflow as hvd_tf
    import hvdlite.tensorflow.keras as hvd
    if method.endswith("_converted"):
        from tensorflow.python.autograph.core import config
        config.CONVERSION_RULES = tuple(r for r in config.CONVERSION_RULES
                                        if getattr(r, "_prefix", None) != "hvdlite")
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.01)
    base = method.removesuffix("_converted")
    if base == "optimizer":
        optimizer = hvd.DistributedOptimizer(optimizer)
    optimizer.build(model.trainable_variables)  # else the first call traces twice (it makes the slots)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((32, 64), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, 32))

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if base == "tape":
            tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    start = time.perf_counter()
    step(x, y).numpy()
    first = time.perf_counter() - start
    later = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y).numpy()
        later.append(time.perf_counter() - start)
    hvd.shutdown()
    return {"method": method, "first_call_s": first, "steady_call_s": statistics.median(later)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="later calls timed after the first, per process")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)), flush=True)
        return
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    if "plain" not in methods:
        methods.insert(0, "plain")
    output = _common.Output(0, args.out)
    output.emit(_common.machine_info("autograph_trace", 1, rounds=args.rounds, steps=args.steps))
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_common.ROOT),
                                                                      os.environ.get("PYTHONPATH")])))
    for round_index in range(args.rounds):
        order = methods if round_index % 2 == 0 else methods[::-1]  # alternate, so drift hits all alike
        for method in order:
            proc = subprocess.run([sys.executable, __file__, "--child", method, "--steps", str(args.steps)],
                                  capture_output=True, text=True, timeout=600, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"autograph_trace: the {method} process failed ({proc.returncode}):\n"
                                 f"{proc.stderr[-3000:]}")
            results[method].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    plain_first = statistics.median(r["first_call_s"] for r in results["plain"])
    for method in methods:
        first = statistics.median(r["first_call_s"] for r in results[method])
        output.emit({"bench": "autograph_trace", "method": method, "rounds": args.rounds,
                     "first_call_s": first,
                     "first_call_range_s": [min(r["first_call_s"] for r in results[method]),
                                            max(r["first_call_s"] for r in results[method])],
                     "steady_call_s": statistics.median(r["steady_call_s"] for r in results[method]),
                     "first_over_plain": first / plain_first, "added_s": first - plain_first})
    output.close()


if __name__ == "__main__":
    main()
