"""Structured results from a worker rank: one JSON file per rank (``$HVDT_WORKER_REPORT_DIR/rank<r>.json``),
as the in-rank harness reports, so that a test asserts on values instead of searching the job's output."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The variable run_mpi(report_dir=...) sets for the job.
REPORT_DIR_VARIABLE = "HVDT_WORKER_REPORT_DIR"


def report(rank: int, **fields: Any) -> None:
    """Write this rank's results (JSON-serialisable fields), atomically; a no-op outside a reporting test."""
    directory = os.environ.get(REPORT_DIR_VARIABLE)
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory, f"rank{rank}.json")
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"rank": rank, **fields}))
    os.replace(partial, path)
