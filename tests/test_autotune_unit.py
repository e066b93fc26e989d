"""Autotune's logic in one process: the search space, the Bayesian tuner, step and sample accounting with a
fake clock, the settings and the error without the library."""
from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hvdlite.core.config import Config
from hvdlite.core.engine import autotune
from hvdlite.core.engine.autotune import BOUNDS, MIB, TEST_POINTS, TUNED, Autotuner, BayesTuner, from_unit, to_unit
from hvdlite.core.engine.negotiation import FLAG_EXPLAIN
from hvdlite.core.engine.observers import CycleObserver
from hvdlite.core.engine.requests import Kind, Response, make_signature
from hvdlite.core.engine.timeline import Timeline
from hvdlite.core.reduce_ops import Sum

START = {"fusion_threshold_bytes": 0, "cycle_time_ms": 1.0, "allreduce_chunk_bytes": 64 * MIB}


def within_bounds(settings: dict[str, Any]) -> bool:
    return all(BOUNDS[n][0] <= settings[n] <= BOUNDS[n][1] for n in TUNED) and set(settings) == set(TUNED)


def test_unit_cube_round_trip_and_bounds() -> None:
    rng = np.random.default_rng(1)
    for x in rng.random((200, 3)) * 1.4 - 0.2:  # also outside the cube: clipped
        settings = from_unit(x)
        assert within_bounds(settings)
        np.testing.assert_allclose(to_unit(from_unit(to_unit(settings))), to_unit(settings), atol=1e-3)
    assert from_unit([0, 0, 0]) == {"fusion_threshold_bytes": 0, "cycle_time_ms": 0.1,
                                    "allreduce_chunk_bytes": 64 * 1024}
    assert from_unit([1, 1, 1]) == {"fusion_threshold_bytes": 64 * MIB, "cycle_time_ms": 20.0,
                                    "allreduce_chunk_bytes": 64 * MIB}


def synthetic_score(s: dict[str, Any]) -> float:
    """Best near fusion 24 MiB, cycle 0.5 ms, chunk 2 MiB."""
    best = {"fusion_threshold_bytes": 24 * MIB, "cycle_time_ms": 0.5, "allreduce_chunk_bytes": 2 * MIB}
    u = to_unit(s) - to_unit(best)
    return float(1e9 * np.exp(-4 * np.dot(u, u)))


def test_tuner_asks_start_then_test_points_then_proposals_within_bounds() -> None:
    tuner = BayesTuner(START, max_samples=10, noise=0.1, seed=3)
    asked = []
    while not tuner.done:
        s = tuner.ask()
        assert within_bounds(s)
        asked.append(s)
        tuner.tell(s, synthetic_score(s))
    assert asked[0] == START and asked[1:3] == list(TEST_POINTS)
    assert len(asked) == len(tuner.samples) == 10  # the budget is respected
    index, best, score = tuner.best()
    assert score == max(synthetic_score(s) for s in asked) and best == asked[index]
    assert score > max(synthetic_score(s) for s in asked[:3])  # the Gaussian process found better than the seeds


def test_best_keeps_the_first_of_equal_scores() -> None:
    tuner = BayesTuner(START, max_samples=3, noise=0.8)
    for s, score in ((START, 5.0), (TEST_POINTS[0], 7.0), (TEST_POINTS[1], 7.0)):
        tuner.tell(s, score)
    assert tuner.best() == (1, TEST_POINTS[0], 7.0)


def response(name: str, floats: int) -> Response:
    return Response(name, make_signature(Kind.ALLREDUCE, 0, Sum, 1.0, 1.0, 0, (("float32", (floats,)),)))


def test_samples_steps_scores_and_final_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's accounting driven by a fake clock: a step is one round of the same names; each sample's score is
    its bytes over its seconds; the best sample is the final choice; nothing is proposed after the budget."""
    log = tmp_path / "tune.csv"
    config = Config(autotune=True, autotune_log_file=str(log), autotune_warmup_samples=1,
                    autotune_steps_per_sample=3, autotune_bayes_opt_max_samples=4, **START)
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    observer = CycleObserver(config, 0, 1, None, Timeline())  # what the engine's cycle calls, without MPI
    tuner = observer.autotune
    names = [("a", 1000), ("b", 250)]  # 5000 bytes per step, in two cycles
    cycle, switches = 0, []
    for _ in range(200):
        cycle += 1
        if observer.flags(0.0) & FLAG_EXPLAIN:  # rank 0's proposal asks for a full round, which carries it
            observer.adopt(observer.outgoing(), cycle)
            switches.append(dict(tuner.settings()))
        for name, floats in names:
            tuner.observe([response(name, floats)])
            clock[0] += 1.0 / (1.0 + synthetic_score(tuner.settings()) / 1e9)  # better settings: faster steps
    assert not tuner.active and tuner.final == config_settings(config) == tuner.settings()
    rows = list(csv.DictReader(log.open()))
    assert [r["phase"] for r in rows] == ["warmup", "sample", "sample", "sample", "sample", "final"]
    for r in rows[:-1]:
        assert (int(r["steps"]), int(r["bytes"])) == (3, 3 * 5000)
        assert float(r["score_bytes_per_s"]) == pytest.approx(15000 / float(r["seconds"]), rel=1e-5)
    scored = rows[1:-1]
    best = max(scored, key=lambda r: float(r["score_bytes_per_s"]))
    assert rows[-1]["sample"] == best["sample"]
    assert (int(rows[-1]["fusion_threshold_bytes"]) == tuner.final["fusion_threshold_bytes"]
            == int(best["fusion_threshold_bytes"]))
    assert len(switches) == 5  # the start, three proposals, the final choice: the budget is respected
    assert switches[0] == START and switches[-1] == tuner.final


def config_settings(config: Config) -> dict[str, Any]:
    return {name: getattr(config, name) for name in TUNED}


def test_other_ranks_only_adopt() -> None:
    config = Config(autotune=True, **START)
    observer = CycleObserver(config, 1, 2, None, Timeline())
    tuner = observer.autotune
    assert not observer.flags(0.0) and observer.outgoing() is None
    observer.adopt(None, 6)  # a full round without a proposal changes nothing
    tuner.observe([response("a", 10)])  # rank 1 never measures
    tuner.adopt({**TEST_POINTS[1], "final": True}, 7)
    assert tuner.history == [(7, TEST_POINTS[1])] and tuner.final == TEST_POINTS[1] and not tuner.active
    assert config.cycle_time_ms == TEST_POINTS[1]["cycle_time_ms"]


def test_settings_from_horovod_variables() -> None:
    config = Config.from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/x.csv",
                              "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "2", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5",
                              "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9",
                              "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"})
    assert (config.autotune, config.autotune_log_file, config.autotune_warmup_samples,
            config.autotune_steps_per_sample, config.autotune_bayes_opt_max_samples,
            config.autotune_gaussian_process_noise) == (True, "/tmp/x.csv", 2, 5, 9, 0.5)
    assert Config.from_env({"HVDLITE_AUTOTUNE_LOG_FILE": "a", "HOROVOD_AUTOTUNE_LOG": "b"}).autotune_log_file == "a"
    defaults = Config.from_env({})
    assert (defaults.autotune, defaults.autotune_warmup_samples, defaults.autotune_steps_per_sample,
            defaults.autotune_bayes_opt_max_samples, defaults.autotune_gaussian_process_noise) == \
        (False, 3, 10, 20, 0.8)
    with pytest.raises(ValueError, match="autotune_steps_per_sample must be >= 1, got 0"):
        Config.from_env({}, autotune_steps_per_sample=0)


def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.gaussian_process", None)
    with pytest.raises(ImportError, match=r"pip install 'hvdlite\[autotune\]'"):
        autotune.require_library()
    with pytest.raises(ImportError, match="needs scikit-learn"):
        Autotuner(Config(autotune=True), 0)
