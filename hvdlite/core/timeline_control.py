"""The public controls of the running job's observability: the Chrome-trace timeline, the engine's counters and
the straggler report."""
from __future__ import annotations

from typing import Any

from .runtime import state

__all__ = ["start_timeline", "stop_timeline", "engine_stats", "straggler_report"]


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (rank 0 writes it)."""
    st = state()
    if st.rank == 0:
        st.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    st = state()
    st.timeline.stop()


def engine_stats() -> dict[str, int]:
    """Counters of the engine: negotiation cycles, full rounds, MPI data calls."""
    return state().engine.stats()


def straggler_report() -> dict[str, Any]:
    """Per rank, how late it submitted the last ``straggler_window_ops`` agreed ops the ranks exchanged (they
    exchange every that many ops, and every ``straggler_window_seconds``, so a few dozen steps give a report):
    mean and p95 milliseconds after the first rank, and the share of ops it submitted last; plus the rank named
    as the straggler (or None). The same dict on every rank read at the same point of the program; zeros
    before the first exchange."""
    return state().engine.stragglers.report()
