"""The public controls of the running job's observability: the Chrome-trace timeline and the engine's counters."""
from __future__ import annotations

from .runtime import state

__all__ = ["start_timeline", "stop_timeline", "engine_stats"]


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
