"""What watches the engine's cycle beside its work: straggler attribution and autotuning, behind one interface."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..config import Config
from .autotune import Autotuner
from .negotiation import FLAG_EXCHANGE, FLAG_EXPLAIN
from .stragglers import Stragglers
from .timeline import Timeline


class CycleObserver:
    """The engine loop's one view of its bookkeeping (flags a round raises, settings a full round carries, agreed
    ops before and after they run); every rank calls it in the same cycle, so what it decides is agreed."""

    def __init__(self, config: Config, rank: int, size: int, mpi_ops: Any, timeline: Timeline) -> None:
        self.autotune = Autotuner(config, rank)  # its settings are the config's, which every reader reads
        self.stragglers = Stragglers(config, rank, size, mpi_ops)
        self.timeline = timeline

    def flags(self, now: float) -> int:
        """The flags this rank raises in the cycle starting at ``now``: an explaining round for rank 0's new
        settings, the exchange of straggler times when rank 0's clock says one is due."""
        raised = FLAG_EXPLAIN if self.autotune.proposal is not None else 0
        return raised | FLAG_EXCHANGE if now >= self.stragglers.tick_at else raised

    def agreed(self, all_flags: int) -> None:
        """Every rank, after the bit-vector round: the flags the job raised."""
        if all_flags & FLAG_EXCHANGE:
            self.stragglers.tick()  # every rank in this cycle: the next cycle with agreed ops exchanges

    def outgoing(self) -> Optional[dict[str, Any]]:
        """What this rank's full round carries: rank 0's proposed settings, once."""
        proposal, self.autotune.proposal = self.autotune.proposal, None
        return proposal

    def adopt(self, proposal: Optional[dict[str, Any]], cycle: int) -> None:
        """Rank 0's proposal from a full round, adopted by every rank at the same cycle."""
        if proposal is not None:
            self.autotune.adopt(proposal, cycle)

    def before_run(self, agreed: list[Any], pending: dict[Any, Any], now: float, known: Optional[np.ndarray]) -> None:
        """The agreed ops of a round ending at ``now``, before they run (``known``: see Stragglers.record)."""
        self.stragglers.record(agreed, pending, now, self.timeline, known)
        self.autotune.observe(agreed)

    def after_run(self, comm: Any) -> None:
        """After each cycle (its ops ran): a step of the exchange of straggler times (rank 0's log line, timeline)."""
        self.stragglers.swap(comm, self.timeline)
