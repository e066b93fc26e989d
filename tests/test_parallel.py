"""Spawns every in-rank test file of tests/parallel/ under ``mpiexec -n N``, one test per (file, size).

A file's sizes are its ``MPI_SIZES = (...)`` line (default 2 and 3); its optional ``SPAWN_TIMEOUT = S`` line
bounds the whole job, so a deadlock fails fast. Each failure is reported with the in-rank test's name and
the rank it failed on. A file's optional ``VARIANTS = ("", "NAME=VALUE ...")`` line runs it once per entry,
each time with those environment variables set in the ranks ("" is the plain run); the variant joins the
test id (``test_keras_fit-np2-TF_USE_LEGACY_KERAS=1``). Variables that must be set before an import (such as
TF_USE_LEGACY_KERAS, read when TensorFlow is imported) can only be varied this way, per process.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import PARALLEL, run_parallel


def _setting(text: str, name: str, default: str) -> str:
    found = re.search(rf"^{name} = (.+)$", text, flags=re.M)
    return found.group(1) if found else default


def _cases() -> list:
    cases = []
    for path in sorted(PARALLEL.glob("test_*.py")):
        text = path.read_text()
        sizes = [int(s) for s in re.findall(r"\d+", _setting(text, "MPI_SIZES", "(2, 3)"))]
        timeout = float(_setting(text, "SPAWN_TIMEOUT", "600"))
        variants = re.findall(r'"([^"]*)"', _setting(text, "VARIANTS", '("",)'))
        for variant in variants:
            env = dict(item.split("=", 1) for item in shlex.split(variant))
            for n in sizes:
                cases.append(pytest.param(path.name, n, timeout, env,
                                          id="-".join(filter(None, [f"{path.stem}-np{n}", variant.replace(" ", "-")])),
                                          marks=pytest.mark.timeout(timeout + 60)))
    return cases


@pytest.mark.parametrize("module,n,timeout,env", _cases())
def test_in_ranks(module: str, n: int, timeout: float, env: dict, tmp_path: Path) -> None:
    run_parallel(module, n, tmp_path / "reports", timeout=timeout, env=env)


def test_harness_names_the_failed_test_and_rank_and_keeps_ranks_in_step(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        run_parallel("selftest_failures.py", 2, tmp_path / "reports", timeout=120)
    text = str(info.value)
    assert "rank 1: " in text and "test_fails_on_rank_one_after_a_pending_op FAILED (call)" in text, text
    assert "deliberate failure on rank 1" in text, text
    assert "rank 0: " not in text.split("--- stdout")[0], text
    assert "test_ranks_are_in_step_afterwards FAILED" not in text, text
