"""Horovod's settings as Horovod programs set them: every HOROVOD_LOG_LEVEL, HOROVOD_TIMELINE=DYNAMIC."""
from __future__ import annotations

import json
import logging
import subprocess
import textwrap
from pathlib import Path

import pytest

from cluster.fixtures import PYTHON, base_env
from hvdlite.core import log
from hvdlite.core.config import Config

RUN = [PYTHON, "-m", "hvdlite.run"]


@pytest.mark.parametrize("raw, name, number", [
    ("trace", "TRACE", 5), ("TRACE", "TRACE", 5), ("debug", "DEBUG", logging.DEBUG),
    ("Info", "INFO", logging.INFO), ("warning", "WARNING", logging.WARNING), ("ERROR", "ERROR", logging.ERROR),
    ("fatal", "FATAL", logging.CRITICAL), (" Fatal ", "FATAL", logging.CRITICAL)])
def test_every_horovod_log_level(raw: str, name: str, number: int) -> None:
    for variable in ("HOROVOD_LOG_LEVEL", "HVDLITE_LOG_LEVEL"):
        config = Config.from_env({variable: raw})
        assert config.log_level == name
    assert Config.from_env({}, log_level=raw).log_level == name
    before = log.logger.level
    try:
        log.set_level(Config.from_env({}, log_level=raw).log_level)  # as init() does
        assert log.logger.level == number
        assert logging.getLevelName(number) == ("CRITICAL" if name == "FATAL" else name)
    finally:
        log.logger.setLevel(before)


def test_unknown_log_level_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        Config.from_env({"HOROVOD_LOG_LEVEL": "verbose"})
    assert str(info.value) == ("log_level must be one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL (any case), "
                               "got 'verbose'")


def test_trace_level_shows_debug_records_and_fatal_hides_errors() -> None:
    """In a real process: HOROVOD_LOG_LEVEL=trace lets debug records through, fatal drops error records;
    HVDLITE_LOG_HIDE_TIME=0 puts the time in front of each line."""
    program = textwrap.dedent("""
        import hvdlite as hvd
        from hvdlite.core.log import logger, TRACE
        hvd.init()
        logger.log(TRACE, "trace-record")
        logger.debug("debug-record")
        logger.error("error-record")
        logger.critical("critical-record")
        hvd.shutdown()
    """)
    def stderr(**env: str) -> str:
        proc = subprocess.run([PYTHON, "-c", program], env=base_env(**env), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr
    lines = [line for line in stderr(HOROVOD_LOG_LEVEL="trace").splitlines() if line.endswith("-record")]
    assert lines == ["[hvdlite rank 0] TRACE: trace-record", "[hvdlite rank 0] DEBUG: debug-record",
                     "[hvdlite rank 0] ERROR: error-record", "[hvdlite rank 0] CRITICAL: critical-record"]
    lines = [line for line in stderr(HOROVOD_LOG_LEVEL="FATAL").splitlines() if line.endswith("-record")]
    assert lines == ["[hvdlite rank 0] CRITICAL: critical-record"]
    lines = [line for line in stderr(HOROVOD_LOG_LEVEL="error", HVDLITE_LOG_HIDE_TIME="0").splitlines()
             if line.endswith("-record")]
    assert len(lines) == 2
    import re
    for line in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[hvdlite rank 0\] (ERROR|CRITICAL): \w+-record",
                            line), line


DYNAMIC_PROGRAM = textwrap.dedent("""
    import os, sys, json
    import numpy as np
    import hvdlite as hvd
    hvd.init()
    hvd.allreduce(np.ones(3), name="before_start")
    listing = sorted(os.listdir("."))
    if hvd.rank() == 0:
        print("BEFORE " + json.dumps(listing), flush=True)
    hvd.start_timeline(sys.argv[1])
    hvd.allreduce(np.ones(3), name="while_recording")
    hvd.stop_timeline()
    hvd.shutdown()
""")


@pytest.mark.parametrize("variable", ["HOROVOD_TIMELINE", "HVDLITE_TIMELINE"])
def test_timeline_dynamic_writes_nothing_until_start_timeline(tmp_path: Path, nproc: int, variable: str) -> None:
    """HOROVOD_TIMELINE=DYNAMIC: no file at init (no file named DYNAMIC), start_timeline() writes the trace."""
    script = tmp_path / "dyn.py"
    script.write_text(DYNAMIC_PROGRAM)
    work = tmp_path / "work"
    work.mkdir()
    trace = tmp_path / "trace.json"
    proc = subprocess.run([*RUN, "-np", str(nproc), "-x", f"{variable}=DYNAMIC", PYTHON, str(script), str(trace)],
                          env=base_env(), cwd=work, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = [line for line in proc.stdout.splitlines() if line.startswith("BEFORE ")]
    assert before == ["BEFORE []"], proc.stdout
    assert sorted(p.name for p in work.iterdir()) == []
    events = json.loads(trace.read_text())
    rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert rows == {"while_recording"}
