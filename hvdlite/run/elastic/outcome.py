"""The elastic driver's verdicts: how a job none of whose ranks reached hvd.elastic.run ended, and when no slot can
come back."""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from ..hosts import Host, total_slots


def none_joined(code: int, size: int, joined_before: bool, in_process: bool, log: logging.Logger) -> str:
    """The outcome of a job none of whose ``size`` ranks reached hvd.elastic.run: "done" (a program that does not
    use it, exit code 0, where that code can be believed), "fatal" (it fails at start-up), or a reset: once a rank
    of this run reached it (``joined_before``), ranks that end before it were lost, like any other. Under ULFM
    Open MPI's launcher exits 0 even when every rank was killed by a signal, so its 0 proves nothing."""
    if joined_before:
        return (f"none of the {size} ranks reached hvd.elastic.run (lost before it: killed, or failed at start-up; "
                f"the launcher exited {code}), while this run's earlier ranks did")
    if code == 0 and not in_process:
        log.warning("no rank used hvd.elastic.run; the job exited 0: done")
        return "done"
    return "fatal"


def fatal_message(code: int, in_process: bool) -> str:
    """Why the driver stops a job that ended before any rank reached hvd.elastic.run (none_joined's "fatal")."""
    ulfm = (" (under ULFM the launcher exits 0 even when ranks were killed, so that 0 says nothing of how they "
            "ended)" if in_process and not code else "")
    return (f"stopping: the job exited {code} before any rank reached hvd.elastic.run{ulfm} (the program fails at "
            f"start-up, or it does not use hvd.elastic.run); not restarting it")


def hopeless(fixed: Optional[Sequence[Host]], for_good: Sequence[str], min_np: int) -> str:
    """Why fewer than ``min_np`` slots can ever be usable again ("" while some may come back): the hosts are
    ``fixed`` (no discovery script) and those left after the ones blacklisted ``for_good`` are too few."""
    if fixed is None or not for_good:
        return ""
    left = total_slots([h for h in fixed if h.name not in for_good])
    if left >= min_np:
        return ""
    return (f"host(s) {','.join(for_good)} blacklisted for good (their ranks failed repeatedly, and no "
            f"--blacklist-cooldown-range lets them back); the other fixed hosts have {left} slot(s), fewer than "
            f"--min-np {min_np}, and no discovery script can add any")


def below_min_np(outcome: str, alive: int, min_np: int) -> str:
    """Why an in-process job with ``alive`` survivors is stopped (``outcome``: the loss that left them)."""
    return (f"{outcome}; {alive} rank(s) left, below --min-np {min_np}: in-process mode cannot add ranks to a running "
            f"job (Open MPI 5.0 cannot grow it safely: docs/elastic.md, Growth), so the job starts again from its last "
            f"commit once {min_np} slots are usable")
