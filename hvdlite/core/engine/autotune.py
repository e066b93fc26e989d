"""Autotune: rank 0 scores the engine's settings while training runs and proposes better ones (GP + EI).

Steps, samples, scores and the search: README.md, "Autotune". Only rank 0 measures and decides; its proposal
travels in its message of a full round, and every rank adopts it after that round: all switch at the same cycle.
"""
from __future__ import annotations

import csv
import math
import time
import warnings
from typing import Any, Iterable, Optional, cast

import numpy as np

from ..config import Config
from ..log import logger
from ..reduce_ops import storage_dtype
from .requests import Kind

MIB = 1 << 20
TUNED = ("fusion_threshold_bytes", "cycle_time_ms", "allreduce_chunk_bytes")
#: (low, high, log scale) of each tuned setting (bytes, ms, bytes).
BOUNDS: dict[str, tuple[float, float, bool]] = {
    "fusion_threshold_bytes": (0.0, 64.0 * MIB, False),
    "cycle_time_ms": (0.1, 20.0, True),
    "allreduce_chunk_bytes": (64.0 * 1024, 64.0 * MIB, True),
}
#: Fixed points scored after the start settings, before the Gaussian process has enough samples to guide.
TEST_POINTS = ({"fusion_threshold_bytes": 4 * MIB, "cycle_time_ms": 1.0, "allreduce_chunk_bytes": 1 * MIB},
               {"fusion_threshold_bytes": 16 * MIB, "cycle_time_ms": 0.3, "allreduce_chunk_bytes": 4 * MIB})
LOG_COLUMNS = ("phase", "sample", *TUNED, "score_bytes_per_s", "steps", "bytes", "seconds")
_ROW_SHAPED = (Kind.ALLGATHER, Kind.ALLTOALL)  # their signature holds only the shape beyond the first dimension
CANDIDATES = 2048  # random points the acquisition function is maximised over


def require_library() -> None:
    """Raise a clear ImportError when the Gaussian-process library of the ``autotune`` extra is missing."""
    try:
        import scipy.special  # noqa: F401
        import sklearn.gaussian_process  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"autotune=1 (HVDLITE_AUTOTUNE / HOROVOD_AUTOTUNE / hvdlite-run --autotune) needs "
                          f"scikit-learn for its Gaussian process, which is not importable here ({exc}). Install "
                          f"the extra: pip install 'hvdlite[autotune]', or turn autotune off.") from None


def to_unit(settings: dict[str, float]) -> np.ndarray:
    """Settings -> a point of the unit cube (log axes for cycle time and chunk size)."""
    out = []
    for name in TUNED:
        low, high, log = BOUNDS[name]
        value = min(max(float(settings[name]), low), high)
        out.append((math.log(value / low) / math.log(high / low)) if log else (value - low) / (high - low))
    return np.array(out)


def from_unit(x: Iterable[float]) -> dict[str, Any]:
    """A point of the unit cube -> settings (bytes rounded to whole KiB, milliseconds to 0.01)."""
    settings: dict[str, Any] = {}
    for name, u in zip(TUNED, x):
        low, high, log = BOUNDS[name]
        u = min(max(float(u), 0.0), 1.0)
        value = low * (high / low) ** u if log else low + u * (high - low)
        if name == "cycle_time_ms":
            settings[name] = round(min(max(value, low), high), 2)
        else:
            settings[name] = int(min(max(round(value / 1024) * 1024, low), high))
    return settings


class BayesTuner:
    """Which settings to score next: the start, the test points, then the GP's maximum of expected improvement."""

    def __init__(self, start: dict[str, Any], max_samples: int, noise: float, seed: int = 0) -> None:
        self.max_samples = max_samples
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.queue: list[dict[str, Any]] = [from_unit(to_unit(start))]
        self.queue += [p for p in TEST_POINTS if p != self.queue[0]]
        self.samples: list[tuple[dict[str, Any], float]] = []

    @property
    def done(self) -> bool:
        return len(self.samples) >= self.max_samples

    def ask(self) -> dict[str, Any]:
        if self.queue:
            return self.queue.pop(0)
        return from_unit(self._expected_improvement_max())

    def tell(self, settings: dict[str, Any], score: float) -> None:
        self.samples.append((dict(settings), float(score)))

    def best(self) -> tuple[int, dict[str, Any], float]:
        """(index, settings, score) of the best sample so far (the first one among equals)."""
        index = max(range(len(self.samples)), key=lambda i: (self.samples[i][1], -i))  # (settings, score) each
        settings, score = self.samples[index]
        return index, settings, score

    def _expected_improvement_max(self) -> np.ndarray:
        from scipy.special import ndtr
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import ConstantKernel, Matern

        x = np.array([to_unit(s) for s, _ in self.samples])
        y = np.array([score for _, score in self.samples])
        y = (y - y.mean()) / (y.std() or 1.0)
        kernel = ConstantKernel(1.0, (1e-2, 1e2)) * Matern(length_scale=[0.3] * len(TUNED),
                                                            length_scale_bounds=(0.05, 5.0), nu=2.5)
        gp = GaussianProcessRegressor(kernel=kernel, alpha=self.noise ** 2, normalize_y=False,
                                      random_state=int(self.rng.integers(1 << 31)))
        with warnings.catch_warnings():  # few, noisy samples: length scales often sit at a bound; that is fine
            warnings.simplefilter("ignore", ConvergenceWarning)
            gp.fit(x, y)
        best_x = x[int(np.argmax(y))]
        local = np.clip(best_x + self.rng.normal(0.0, 0.1, size=(CANDIDATES // 4, len(TUNED))), 0.0, 1.0)
        cand = np.vstack([self.rng.random((CANDIDATES, len(TUNED))), local])
        mu, sigma = gp.predict(cand, return_std=True)
        sigma = np.maximum(sigma, 1e-9)
        improvement = mu - y.max() - 0.01
        z = improvement / sigma
        ei = improvement * ndtr(z) + sigma * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return cast(np.ndarray, cand[int(np.argmax(ei))])


class Autotuner:
    """The engine's side: every rank adopts agreed settings; rank 0 also measures steps and proposes."""

    def __init__(self, config: Config, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.active = bool(config.autotune)
        self.history: list[tuple[int, dict[str, Any]]] = []  # (cycle, settings) of every switch, every rank
        self.final: Optional[dict[str, Any]] = None
        self.proposal: Optional[dict[str, Any]] = None  # rank 0's settings for a full round to carry (observers.py)
        if not (self.active and rank == 0):
            return
        require_library()
        self.tuner = BayesTuner(self.settings(), config.autotune_bayes_opt_max_samples,
                                config.autotune_gaussian_process_noise)
        self.current = self.tuner.ask()
        self._warmup_left = config.autotune_warmup_samples
        self._sample = 0
        self._scored_ids: list[int] = []  # log sample number of each scored sample, in tuner order
        self.proposal = dict(self.current, final=False)  # start from the grid-rounded start settings
        self._waiting = True
        self._started = False
        self._seen: set[tuple[int, str]] = set()
        self._steps = self._bytes = 0
        self._t0 = 0.0
        self._log: Any = None
        if config.autotune_log_file:
            self._log = open(config.autotune_log_file, "w", newline="", encoding="utf-8")  # noqa: SIM115
            self._writer = csv.writer(self._log)
            self._writer.writerow(LOG_COLUMNS)
            self._log.flush()

    def settings(self) -> dict[str, Any]:
        return {name: getattr(self.config, name) for name in TUNED}

    # -- every rank ---------------------------------------------------------------------------------------
    def adopt(self, proposal: dict[str, Any], cycle: int) -> None:
        """Switch to rank 0's settings; called on every rank after the same negotiation round."""
        values = {name: proposal[name] for name in TUNED}
        for name, value in values.items():
            setattr(self.config, name, value)
        self.history.append((cycle, values))
        if proposal.get("final"):
            self.active = False
            self.final = values
            logger.info("autotune chose fusion_threshold_bytes=%d, cycle_time_ms=%g, allreduce_chunk_bytes=%d",
                        values["fusion_threshold_bytes"], values["cycle_time_ms"], values["allreduce_chunk_bytes"])
        if self.rank == 0:
            self._waiting = False
            self._started = False
            self._seen = set()

    # -- rank 0 ---------------------------------------------------------------------------------------------
    def observe(self, responses: list[Any]) -> None:
        """Count this cycle's agreed data collectives (before they run) into steps and samples."""
        if self.rank != 0 or not self.active or self._waiting:
            return
        keys = {r.key for r in responses if r.error is None and r.sig.tensors}
        if not keys:
            return
        if keys & self._seen:
            self._boundary(time.perf_counter())
            self._seen = set()
        self._seen |= keys
        if self._started:
            self._bytes += sum(math.prod(shape) * storage_dtype(dtype).itemsize for r in responses
                               if r.error is None and r.sig.kind not in _ROW_SHAPED for dtype, shape in r.sig.tensors)

    def _boundary(self, now: float) -> None:
        if not self._started:
            self._started, self._t0, self._steps, self._bytes = True, now, 0, 0
            return
        self._steps += 1
        if self._steps < self.config.autotune_steps_per_sample:
            return
        seconds = max(now - self._t0, 1e-9)
        score = self._bytes / seconds
        row = [self._sample, *self.current.values(), f"{score:.6g}", self._steps, self._bytes, f"{seconds:.6g}"]
        self._sample += 1
        if self._warmup_left > 0:
            self._warmup_left -= 1
            self._write("warmup", row)
            self._t0, self._steps, self._bytes = now, 0, 0  # same settings: the next sample starts here
            return
        self._write("sample", row)
        self._scored_ids.append(row[0])
        self.tuner.tell(self.current, score)
        if self.tuner.done:
            index, best, best_score = self.tuner.best()
            self._write("final", [self._scored_ids[index], *best.values(), f"{best_score:.6g}", "", "", ""])
            self.current, proposal = best, dict(best, final=True)
            if self._log is not None:
                self._log.close()
                self._log = None
        else:
            self.current = self.tuner.ask()
            proposal = dict(self.current, final=False)
        logger.debug("autotune sample %d scored %.4g bytes/s; next %s", self._sample - 1, score, proposal)
        self.proposal, self._waiting, self._started = proposal, True, False

    def _write(self, phase: str, row: list[Any]) -> None:
        if self._log is not None:
            self._writer.writerow([phase, *row])
            self._log.flush()
