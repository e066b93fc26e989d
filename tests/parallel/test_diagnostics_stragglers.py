"""Straggler attribution: the last rank sleeps 20 ms before each training step (torch and Keras); every rank's
hvd.straggler_report() is the same dict and names that rank with about 20 ms of lateness; the log names it
once; rank 0's timeline shows each op's lateness per rank."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import hvdlite as hvd_core  # noqa: E402
import hvdlite.torch as hvd  # noqa: E402

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 300
SLEEP_S = 0.020
WINDOW = 16  # ops per straggler window


def _true_lateness_ms(stamps: list[float], size: int, steps: int) -> float:
    """The slow rank's real lateness at the submitting call, from every rank's CLOCK_MONOTONIC (one clock on
    one host): the mean over the last ``steps`` steps (the report's window when a step submits one op). At
    least the 20 ms sleep; more on a loaded machine, where the woken rank waits for a core."""
    t = np.array(hvd_core.allgather_object(stamps))
    return float(np.mean((t[size - 1] - t.min(axis=0))[-steps:]) * 1e3)


def _check(report: dict, size: int, true_ms: float) -> None:
    assert len(set(map(repr, hvd_core.allgather_object(report)))) == 1, report  # the same dict everywhere
    slow = size - 1
    assert report["windows"] >= 1 and report["straggler"] == slow, report
    assert true_ms >= SLEEP_S * 1e3 and 0.6 * true_ms < report["ranks"][slow]["mean_ms"] < 1.6 * true_ms, \
        (true_ms, report)
    assert report["ranks"][slow]["last_share"] >= 0.5, report  # last in most ops (the straggler rule)
    for r in range(slow):
        assert report["ranks"][r]["mean_ms"] < 0.4 * report["ranks"][slow]["mean_ms"], report


def test_torch_training_names_the_rank_that_sleeps(reinit, rank: int, size: int, tmp_path_factory,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    layers = 6
    # the optimizer may submit its gradients as one or several ops per step; all of them at step()
    reinit(straggler_window_ops=WINDOW, gradient_overlap="off")
    trace = Path(hvd_core.broadcast_object(str(tmp_path_factory.mktemp("trace") / "t.json")))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(layers)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(4, 8)
    stamps = []
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        for step in range(2 * WINDOW):  # one grouped op per step: the last window is the last WINDOW steps
            if step == WINDOW:
                hvd_core.start_timeline(str(trace))
            if rank == size - 1:
                time.sleep(SLEEP_S)
            opt.zero_grad()
            model(x).square().mean().backward()
            stamps.append(time.monotonic())
            opt.step()
        hvd_core.stop_timeline()
        hvd.barrier()
    true_ms = _true_lateness_ms(stamps, size, WINDOW)
    _check(hvd.straggler_report(), size, true_ms)
    if rank == 0:
        named = [r for r in caplog.records if "is the straggler" in r.getMessage()]
        assert len(named) == 1 and f"rank {size - 1} is the straggler" in named[0].getMessage(), named
        events = json.loads(trace.read_text())
        late = [e["args"][f"rank {size - 1}"] for e in events if e.get("name") == "LATENESS_MS"]
        assert len(late) >= WINDOW and 0.6 * true_ms < float(np.median(late)) < 1.6 * true_ms, (true_ms, late)


def test_keras_fit_names_the_rank_that_sleeps(reinit, rank: int, size: int) -> None:
    import keras
    import hvdlite.tensorflow.keras as hvd_keras

    reinit(straggler_window_ops=WINDOW)

    stamps = []

    class Sleep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            if rank == size - 1:
                time.sleep(SLEEP_S)
            stamps.append(time.monotonic())

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    data = np.random.default_rng(rank).normal(size=(2, 2 * (2 * WINDOW + 4), 6)).astype(np.float32)
    model.fit(data[0], data[1][:, :1], batch_size=2, epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Sleep()])
    hvd_keras.allreduce(np.zeros(1), name="keras.straggler.end")  # every rank past fit before reading
    _check(hvd_keras.straggler_report(), size, _true_lateness_ms(stamps, size, WINDOW))
