"""Autotune in the ranks: rank 0 decides, every rank switches to the same settings at the same cycle, results
stay exact while the settings change, and the log holds every sample and the best one as the final choice."""
from __future__ import annotations

import csv
import os
import tempfile
from typing import Any, Callable

import numpy as np

import hvdlite as hvd
from hvdlite.core import runtime
from hvdlite.core.engine.autotune import BOUNDS, TUNED

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300

WARMUP, STEPS, SAMPLES = 1, 2, 5
SHAPES = [(7,), (300, 1000), (33, 5), (70_000,)]  # small ones fuse; the 1.2 MB one is chunked


def _step(step: int, rank: int, size: int) -> None:
    """One training-like step: a grouped allreduce and two named async ones, each checked exactly."""
    base = [np.arange(np.prod(s), dtype=np.float64).reshape(s) % 97 for s in SHAPES]
    inputs = [b + rank + step for b in base]
    expected = [size * b + sum(range(size)) + size * step for b in base]
    out = hvd.grouped_allreduce(inputs, op=hvd.Sum, name="at.grouped")
    handles = [hvd.allreduce_async(inputs[i], op=hvd.Sum, name=f"at.async.{i}") for i in (0, 1)]
    for got, want in zip(out, expected):
        np.testing.assert_array_equal(got, want)
    for i, h in zip((0, 1), handles):
        np.testing.assert_array_equal(hvd.synchronize(h), expected[i])


def test_autotune_switches_every_rank_at_the_same_cycle(rank: int, size: int,
                                                       reinit: Callable[..., None]) -> None:
    path = os.path.join(tempfile.gettempdir(), f"hvdlite_autotune_{os.getppid()}_{size}.csv")
    path = hvd.broadcast_object(path, root_rank=0, name="at.path")
    reinit(autotune=True, autotune_log_file=path, autotune_warmup_samples=WARMUP,
           autotune_steps_per_sample=STEPS, autotune_bayes_opt_max_samples=SAMPLES,
           fusion_threshold_bytes=0, allreduce_chunk_bytes=64 * 1024 * 1024)
    tuner = runtime.state().engine.observer.autotune
    seen: list[Any] = []
    for step in range(80):
        _step(step, rank, size)
        if step % 10 == 9:  # compare every rank's switches so far (a switch in flight may show on one only)
            hvd.barrier()
            seen.append(list(tuner.history))
    hvd.barrier()
    engine = runtime.state().engine
    mine = {"history": tuner.history, "final": tuner.final, "settings": tuner.settings(),
            "executor": (engine.executor.config.fusion_threshold_bytes, engine.executor.config.allreduce_chunk_bytes),
            "seen": seen}
    everyone = hvd.allgather_object(mine, name="at.views")
    assert all(view == everyone[0] for view in everyone), everyone
    final = tuner.final
    assert final is not None, "the sample budget was not reached in 80 steps"
    assert mine["settings"] == final
    assert mine["executor"] == (final["fusion_threshold_bytes"], final["allreduce_chunk_bytes"])
    history = [values for _, values in tuner.history]
    cycles = [cycle for cycle, _ in tuner.history]
    assert cycles == sorted(set(cycles))
    assert len(history) == SAMPLES + 1  # the start, one switch after each scored sample but the last, final
    for values in history:
        for name in TUNED:
            low, high, _ = BOUNDS[name]
            assert low <= values[name] <= high
    assert history[0] == {"fusion_threshold_bytes": 0, "cycle_time_ms": 1.0, "allreduce_chunk_bytes": 64 * 1024 * 1024}
    _step(1000, rank, size)  # still exact under the final settings
    if rank == 0:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        os.unlink(path)
        assert [r["phase"] for r in rows] == ["warmup"] * WARMUP + ["sample"] * SAMPLES + ["final"]
        logged = [{"fusion_threshold_bytes": int(r["fusion_threshold_bytes"]),
                   "cycle_time_ms": float(r["cycle_time_ms"]),
                   "allreduce_chunk_bytes": int(r["allreduce_chunk_bytes"])} for r in rows]
        assert logged[:WARMUP] == [history[0]] * WARMUP
        assert logged[WARMUP:-1] == history[:-1]  # each sample ran under the settings switched to before it
        scored = rows[WARMUP:-1]
        best = max(range(SAMPLES), key=lambda i: (float(scored[i]["score_bytes_per_s"]), -i))
        assert logged[-1] == logged[WARMUP + best] == history[-1] == final
        assert rows[-1]["sample"] == scored[best]["sample"]
        assert float(rows[-1]["score_bytes_per_s"]) == float(scored[best]["score_bytes_per_s"]) > 0
        assert all(int(r["steps"]) == STEPS and int(r["bytes"]) > 0 for r in rows[:-1])
