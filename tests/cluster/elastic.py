"""Drive an elastic hvdlite-run from a test: stream its output, kill ranks when the training gets somewhere."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import pytest

from conftest import worker_reports

from .fixtures import ROOT, base_env

JOINED = re.compile(r"rank (\d+) of (\d+) joined from host (\S+) \(pid (\d+)\)")


class ElasticRun:
    """An hvdlite-run process whose merged stdout/stderr is collected line by line in a thread."""

    def __init__(self, cmd: Sequence[str], env: Optional[dict[str, str]] = None) -> None:
        self.cmd = list(cmd)
        self.lines: list[str] = []
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or base_env(), cwd=ROOT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        """The first line from index ``start`` on matching ``pattern``, waiting up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            for line in self.lines[start:]:
                match = regex.search(line)
                if match:
                    return match
            if self.proc.poll() is not None and not self._reader.is_alive():
                pytest.fail(f"hvdlite-run ended ({self.proc.returncode}) before printing /{pattern}/:\n{self.output}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no /{pattern}/ within {timeout} s:\n{self.output}")
            time.sleep(0.05)

    def rank_pids(self, size: int, timeout: float = 240) -> dict[int, tuple[str, int]]:
        """(host, pid) of every rank of the newest job of ``size`` ranks, from the driver's log."""
        deadline = time.monotonic() + timeout
        while True:
            found: dict[int, tuple[str, int]] = {}
            for line in self.lines:
                match = JOINED.search(line)
                if match and int(match.group(2)) == size:
                    found[int(match.group(1))] = (match.group(3), int(match.group(4)))
                if "starting" in line and "ranks on" in line:
                    found = {}
            if len(found) == size:
                return found
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                pytest.fail(f"the {size} ranks did not all join (hvdlite-run: {self.proc.poll()}):\n{self.output}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"hvdlite-run ran past {timeout} s:\n{self.output}")
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def discovery_losing_a_slot(directory: Path, slots: int = 3) -> tuple[Path, Path]:
    """A discovery script that lists localhost:SLOTS until its marker file exists, then one slot fewer: a test
    that makes the marker (before it kills a rank) sees the job restart one rank smaller, as it did before a
    killed rank's slot was used again (that a lone death keeps its slot is test_elastic.py's own test)."""
    marker, script = directory / "slot_lost", directory / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {marker} ]; then echo localhost:{slots - 1}; "
                      f"else echo localhost:{slots}; fi\n")
    script.chmod(0o755)
    return script, marker


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0,
               run: Optional[ElasticRun] = None) -> None:
    """Wait for ``condition``; fail naming ``what`` (and stop ``run``, showing its output) if it stays false."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            if run is not None:
                run.kill()
            pytest.fail(f"not within {timeout} s: {what}" + (f"\n{run.output}" if run is not None else ""))
        time.sleep(0.02)


def epoch_lines(output: str) -> list[dict[str, str]]:
    """Rank 0's ``epoch=...`` lines of examples/pytorch_digits_elastic.py, as dicts."""
    return [dict(item.split("=", 1) for item in line.split())
            for line in output.splitlines() if line.startswith("epoch=")]


def assert_every_epoch_exact(output: str, epochs: int, train_size: int = 1440) -> None:
    """Each epoch of examples/pytorch_digits_elastic.py processed every training sample exactly once (the last
    print of each epoch counts)."""
    last: dict[str, dict[str, str]] = {}
    for line in epoch_lines(output):
        last[line["epoch"]] = line
    assert sorted(last, key=int) == [str(e) for e in range(1, epochs + 1)], output
    for epoch, line in last.items():
        assert (int(line["samples"]), int(line["unique"]), int(line["of"])) == (train_size,) * 3, (epoch, output)


def wait_for_progress(report_dir: Path, condition: Callable[[dict[str, Any]], bool], what: str, timeout: float,
                      run: ElasticRun) -> dict[str, Any]:
    """Rank 0's newest ``progress`` report (tests/workers/torch_elastic.py, keras_elastic.py), once ``condition``
    holds for it; fail naming ``what`` (with the job's output) if the job ends or ``timeout`` s pass first."""
    found: dict[str, Any] = {}

    def ready() -> bool:
        progress = worker_reports(report_dir).get(0, {}).get("progress")
        if progress is not None and condition(progress):
            found.update(progress)
            return True
        if run.proc.poll() is not None:
            pytest.fail(f"hvdlite-run ended ({run.proc.returncode}) before rank 0 reported {what}:\n{run.output}")
        return False
    wait_until(ready, f"rank 0 reported {what}", timeout, run)
    return found


def final_reports(report_dir: Path, size: int, output: str) -> dict[str, Any]:
    """The ``final`` report of the last job's ``size`` ranks, after checking that they all reported the same."""
    finals = {rank: entry["final"] for rank, entry in worker_reports(report_dir).items() if "final" in entry}
    assert sorted(finals) == list(range(size)), (finals, output)
    assert all(final == finals[0] for final in finals.values()), (finals, output)
    assert finals[0]["size"] == size, (finals, output)
    return finals[0]


def assert_epochs_exact(final: dict[str, Any], epochs: int, output: str, train_size: int = 1440) -> None:
    """Each epoch, as committed (tests/workers/torch_elastic.py's ``epochs``), processed every training sample
    exactly once, and ran at the learning rate of its size."""
    assert [record["epoch"] for record in final["epochs"]] == list(range(1, epochs + 1)), (final, output)
    for record in final["epochs"]:
        assert (record["samples"], record["unique"], record["of"]) == (train_size,) * 3, (record, output)
        assert record["lr"] == pytest.approx(0.02 * record["size"]), (record, output)
