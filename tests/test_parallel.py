"""Spawns every in-rank test file of tests/parallel/ under ``mpiexec -n N``, one test per (file, size).

The files of one size and variant run in one job (every rank imports torch and TensorFlow once, not once per
file), and each file's test reports that file's verdict from it; ``-k <file stem>`` runs that file alone.

A file's sizes are its ``MPI_SIZES = (...)`` line (default 2 and 3); its optional ``SPAWN_TIMEOUT = S`` line
bounds the whole job, so a deadlock fails fast. Each failure is reported with the in-rank test's name and
the rank it failed on. A file's optional ``VARIANTS = ("", "NAME=VALUE ...")`` line runs it once per entry,
each time with those environment variables set in the ranks ("" is the plain run); the variant joins the
test id (``test_keras_fit-np2-TF_USE_LEGACY_KERAS=1``). Variables that must be set before an import (such as
TF_USE_LEGACY_KERAS, read when TensorFlow is imported) can only be varied this way, per process. An optional
``VARIANT_SIZES = (...)`` line gives the sizes of the variants other than "" (default: MPI_SIZES): a size the
plain run needs (a process set or a power of two) need not cost a job of its own for each variant.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Callable

import pytest

from conftest import PARALLEL, run_parallel, run_parallel_files


def _setting(text: str, name: str, default: str) -> str:
    found = re.search(rf"^{name} = (.+)$", text, flags=re.M)
    return found.group(1) if found else default


def _group(n: int, env: dict) -> tuple:
    """The job that runs a (file, size, variant): every file of that size and variant shares one."""
    return n, tuple(sorted(env.items()))


def _cases() -> list:
    found = []
    for path in sorted(PARALLEL.glob("test_*.py")):
        text = path.read_text()
        sizes = [int(s) for s in re.findall(r"\d+", _setting(text, "MPI_SIZES", "(2, 3)"))]
        timeout = float(_setting(text, "SPAWN_TIMEOUT", "600"))
        variants = re.findall(r'"([^"]*)"', _setting(text, "VARIANTS", '("",)'))
        variant_sizes = [int(s) for s in re.findall(r"\d+", _setting(text, "VARIANT_SIZES", str(sizes)))]
        for variant in variants:
            env = dict(item.split("=", 1) for item in shlex.split(variant))
            for n in variant_sizes if variant else sizes:
                found.append((path, n, timeout, env, variant))
    budget: dict = {}  # a job's time limit: the sum of its files' (each file's SPAWN_TIMEOUT bounds its own share)
    for _, n, timeout, env, _ in found:
        budget[_group(n, env)] = budget.get(_group(n, env), 0.0) + timeout
    return [pytest.param(path.name, n, budget[_group(n, env)], env,
                         id="-".join(filter(None, [f"{path.stem}-np{n}", variant.replace(" ", "-")])),
                         marks=pytest.mark.timeout(budget[_group(n, env)] + 60))
            for path, n, timeout, env, variant in found]


@pytest.fixture(scope="session")
def _jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[str]]:
    """The problems of one file at one size and variant. The first file of a job asked for runs the job, with
    every file of it that this session selected, and keeps every file's verdict for the others."""
    selected: dict = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and getattr(item, "originalname", "") == "test_in_ranks":
            params = callspec.params
            selected.setdefault(_group(params["n"], params["env"]), []).append(params["module"])
    verdicts: dict = {}

    def problems(module: str, n: int, timeout: float, env: dict) -> list[str]:
        group = _group(n, env)
        if group not in verdicts:
            modules = selected.get(group) or [module]
            reports = tmp_path_factory.mktemp(f"np{n}-reports")
            verdicts[group] = run_parallel_files(modules, n, reports, timeout=timeout, env=env)
        return verdicts[group][module]
    return problems


@pytest.mark.parametrize("module,n,timeout,env", _cases())
def test_in_ranks(module: str, n: int, timeout: float, env: dict, _jobs: Callable[..., list[str]]) -> None:
    problems = _jobs(module, n, timeout, env)
    if problems:
        pytest.fail(f"{module} at -n {n}:\n" + "\n".join(problems), pytrace=False)


def test_harness_names_the_failed_test_and_rank_and_keeps_ranks_in_step(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        run_parallel("selftest_failures.py", 2, tmp_path / "reports", timeout=120)
    text = str(info.value)
    assert "rank 1: " in text and "test_fails_on_rank_one_after_a_pending_op FAILED (call)" in text, text
    assert "deliberate failure on rank 1" in text, text
    assert "rank 0: " not in text.split("--- stdout")[0], text
    assert "test_ranks_are_in_step_afterwards FAILED" not in text, text
