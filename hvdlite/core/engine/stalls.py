"""The stall inspector's words and verdicts: what is logged, and which stalled names fail, when ranks wait."""
from __future__ import annotations

from typing import cast

from ..config import Config
from ..log import logger
from .negotiation import Stalled
from .requests import Response, Signature


def warn(stalled: list[Stalled], cfg: Config, since_last_warning: float) -> bool:
    """On rank 0: log the stalled names with the ranks that did and did not submit them (at most once per
    ``stall_check_time_seconds``). Returns whether it logged."""
    worst = max(s.age for s in stalled)
    if worst < cfg.stall_check_time_seconds or since_last_warning < cfg.stall_check_time_seconds:
        return False
    lines = [f"  {s.name} ({s.kind}): submitted by ranks {s.ready_ranks}, missing ranks "
             f"{s.missing_ranks}, waiting {s.age:.1f} s" + (f" ({s.note})" if s.note else "") + s.where
             for s in stalled]
    logger.warning("One or more collectives have waited over %g s for other ranks. The missing "
                   "ranks have not submitted them (they may be stuck, have skipped the op, or "
                   "used a different name):\n%s", cfg.stall_check_time_seconds, "\n".join(lines))
    return True


def verdict(stalled: list[Stalled], cfg: Config) -> list[Response]:
    """One verdict for the job, in this round: once any stalled name is past the shutdown time, every
    stalled name fails now, so each rank waiting on one gets its StallError in the same cycle (not a
    ShutdownError later, after a peer that got its StallError first has moved on and exited)."""
    limit = cfg.stall_shutdown_time_seconds
    if limit <= 0 or max(s.age for s in stalled) < limit:
        return []
    failed = []
    for s in stalled:
        note = f" {s.note[0].upper()}{s.note[1:]}: the ranks disagree on its process set." if s.note else ""
        failed.append(Response(s.name, cast(Signature, s.sig), error_kind="stall", error=(
            f"{s.kind} of {s.name!r} stalled for {s.age:.1f} s (stall_shutdown_time_seconds={limit:g}): "
            f"ranks {s.missing_ranks} never submitted it; ranks {s.ready_ranks} did.{note}{s.where}")))
    return failed


def wedged_message(rank: int, size: int, absent: list[int], waited: float, limit: float, names: list[str]) -> str:
    """Why this rank gives up: an MPI call waited past the limit and these ranks answer no probes."""
    answered = [r for r in range(size) if r not in absent and r != rank]
    return (f"rank {rank}: an MPI call of the engine has waited {waited:.1f} s "
            f"(stall_shutdown_time_seconds={limit:g}): rank(s) {absent} answer no messages (stopped, "
            f"or blocked with the GIL held); rank(s) {answered} did. Pending on this rank: "
            f"{names or 'nothing'}. hvdlite cannot go on with this job: end it and look at rank(s) {absent}.")


def shutdown_message(rank: int, stopping: list[int]) -> str:
    """Why this rank's engine ends when ranks ``stopping`` said in a round that they shut down."""
    if rank in stopping and len(stopping) == 1:
        return f"rank {rank}: hvdlite was shut down on this rank (hvd.shutdown() or process exit)"
    who = ", ".join(map(str, stopping))
    return (f"rank {rank}: hvdlite was shut down because rank(s) {who} called hvd.shutdown() or "
            f"exited while this rank still expected collectives. Look at rank(s) {who} for the cause; "
            f"every rank must run the same collectives before finishing.")
