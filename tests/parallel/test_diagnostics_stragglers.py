"""Straggler attribution: the last rank sleeps 20 ms before each training step (torch here; Keras in
test_diagnostics_keras.py); every rank's hvd.straggler_report() is the same dict and names that rank with
about 20 ms of lateness; the log names it once; rank 0's timeline shows each op's lateness per rank."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hvdlite as hvd_core
import hvdlite.torch as hvd
from hvdlite.core.engine.loop import Engine
from straggler_check import SLEEP_S, WINDOW, check_report, true_lateness_ms

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 300
def test_torch_training_names_the_rank_that_sleeps(reinit, rank: int, size: int, tmp_path_factory,
                                                   caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    layers = 6
    # the optimizer may submit its gradients as one or several ops per step; all of them at step()
    reinit(straggler_window_ops=WINDOW, gradient_overlap="off")
    trace = Path(hvd_core.broadcast_object(str(tmp_path_factory.mktemp("trace") / "t.json")))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(layers)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(4, 8)
    stamps = []  # the common clock (one host) when each gradient op is handed to the engine
    submit = Engine.submit  # every submission path (the per-gradient fast path too) ends here, once per op

    def stamped(self: Engine, *args: object, **kwargs: object) -> object:
        stamps.append(time.monotonic())
        return submit(self, *args, **kwargs)
    monkeypatch.setattr(Engine, "submit", stamped)
    with caplog.at_level(logging.WARNING, logger="hvdlite"):
        for step in range(2 * WINDOW):
            if step == WINDOW:
                hvd_core.start_timeline(str(trace))
            if rank == size - 1:
                time.sleep(SLEEP_S)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        monkeypatch.setattr(Engine, "submit", submit)
        assert len(stamps) >= 2 * WINDOW  # a grouped op per step (and the optimizer's own set-up ops)
        hvd_core.stop_timeline()
        hvd.barrier()
    end = len(stamps) // WINDOW * WINDOW  # the report's last complete window: these ops
    true_ms = true_lateness_ms(stamps[:end], size, WINDOW)
    check_report(hvd.straggler_report(), size, true_ms)
    if rank == 0:
        named = [r for r in caplog.records if "is the straggler" in r.getMessage()]
        assert len(named) == 1 and f"rank {size - 1} is the straggler" in named[0].getMessage(), named
        events = json.loads(trace.read_text())
        late = [e["args"][f"rank {size - 1}"] for e in events if e.get("name") == "LATENESS_MS"]
        assert len(late) >= WINDOW and 0.6 * true_ms[-1] < float(np.median(late)) < 1.6 * true_ms[-1], (true_ms, late)
