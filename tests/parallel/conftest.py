"""In-rank pytest plumbing: every rank of an ``mpiexec -n N python -m pytest tests/parallel/FILE`` job runs
the same tests in the same order, reports each by name, and stays in step with the other ranks.

- hvdlite (the core) is initialised once per job; ``reinit(**settings)`` restarts it with other settings for
  one test and restores the defaults afterwards.
- After every test the ranks exchange their verdicts over raw MPI (not hvdlite, which may be what broke).
  If any rank failed, or any rank's engine died, every rank restarts hvdlite, so that one failure cannot
  desynchronise generated names or leave a half-finished collective behind for the next test.
- ``@pytest.mark.mpi(min_size=K)`` / ``@pytest.mark.mpi(sizes=(2, 4))`` deselect (never skip) tests that do
  not apply to this job's size.
- Each rank writes ``$HVDT_REPORT_DIR/rank<r>.json``: the tests it collected, every test's outcome and, on
  failure, its report, rewritten after each test (one job runs several files); the spawning test
  (tests/test_parallel.py) reads them and names each failed test with its rank.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

import hvdlite as hvd

_reports: list[dict[str, Any]] = []
_collected: list[str] = []  # the node ids this rank will run (after deselection by size)
_settings_changed = False


def _world() -> Any:
    from mpi4py import MPI  # tests may talk to MPI directly; the library's frontends never do
    return MPI.COMM_WORLD


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpi(min_size=None, sizes=None): run only at these job sizes")
    if os.environ.get("HOROVOD_CPU_OPERATIONS") or os.environ.get("HVDT_DEVICE"):
        import hvdlite.torch  # noqa: F401 - its data planes are made at init(), so it registers them first
    hvd.init()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    size = _world().Get_size()
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("mpi")
        ok = True
        if marker is not None:
            min_size = marker.kwargs.get("min_size")
            sizes = marker.kwargs.get("sizes")
            ok = (min_size is None or size >= min_size) and (sizes is None or size in sizes)
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.stash[_FAILED] = True


_FAILED = pytest.StashKey[bool]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        entry: dict[str, Any] = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
        if report.failed:
            entry["longrepr"] = str(report.longrepr)[-6000:]
        _reports.append(entry)
        _write_report()


def _write_report(exitstatus: Optional[int] = None) -> None:
    """This rank's report so far: rewritten after every test (several files share one job: a crash or hang in
    one leaves the earlier files' verdicts readable), with the exit status once the session ends (None
    before)."""
    directory = os.environ.get("HVDT_REPORT_DIR")
    if directory:
        rank = _world().Get_rank()
        path = Path(directory, f"rank{rank}.json")
        path.with_suffix(".tmp").write_text(json.dumps(
            {"rank": rank, "size": _world().Get_size(), "exitstatus": exitstatus, "collected": _collected,
             "tests": _reports}))
        path.with_suffix(".tmp").replace(path)


def pytest_collection_finish(session: pytest.Session) -> None:
    _collected[:] = [item.nodeid for item in session.items]
    _write_report()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_report(int(exitstatus))
    hvd.shutdown()


@pytest.fixture(autouse=True)
def _ranks_in_step(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: agree on whether anything broke; if so, restart hvdlite on every rank."""
    global _settings_changed
    yield
    from mpi4py import MPI
    broken = request.node.stash.get(_FAILED, False) or not _engine_healthy()
    if _world().allreduce(int(broken) or int(_settings_changed), op=MPI.MAX):
        hvd.shutdown()
        hvd.init()
        _settings_changed = False


def _engine_healthy() -> bool:
    if not hvd.is_initialized():
        return False
    try:
        hvd.engine_stats()
    except Exception:  # noqa: BLE001 - any failure here means "restart"
        return False
    from hvdlite.core import runtime
    return runtime.state().engine.error is None


@pytest.fixture
def reinit() -> Callable[..., None]:
    """``reinit(**settings)`` restarts hvdlite on every rank with these init() keywords for this test;
    the defaults are restored after it."""
    def restart(**settings: Any) -> None:
        global _settings_changed
        hvd.shutdown()
        hvd.init(**settings)
        _settings_changed = True
    return restart


@pytest.fixture
def ps() -> Iterator[Any]:
    """The set of every rank but 0 (root_sets.MEMBERS), registered for one test (test_root_rank.py,
    test_tf_root_rank.py)."""
    from root_sets import MEMBERS
    pset = hvd.add_process_set(MEMBERS)
    yield pset
    hvd.remove_process_set(pset)


@pytest.fixture
def rank() -> int:
    return hvd.rank()


@pytest.fixture
def size() -> int:
    return hvd.size()
