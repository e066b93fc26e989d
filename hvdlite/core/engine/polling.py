"""Waiting on MPI requests without taking the core that the training thread needs."""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable, Optional

from .handles import threads_waiting

#: The longest sleep between polls of a data collective while the training thread computes.
POLL_CAP = 1e-4
#: MPI polls without sleeping while a user thread waits (a few tens of microseconds).
SPIN_POLLS = 200
#: While spinning, yield the core every this many polls (as MPI libraries do when oversubscribed). Each
#: yield lets the process scheduler run, which slows a large transfer's progress: ranks that have a core
#: each yield rarely (share_cores sets it).
YIELD_EVERY = 8
#: Polls (yielding the core between them) before the first sleep even when no user thread waits: an
#: exchange with an active peer ends within microseconds, and the shortest sleep costs tens of them.
EAGER_POLLS = 16

#: How long an arrival wait (a negotiation round: see wait) spins on while a user thread waits on an uncrowded
#: node before it backs off: peers of a burst in flight arrive within this; a peer still computing takes far
#: longer, and spinning that long would take its core.
ARRIVAL_SPIN_S = 0.002
#: Whether the last arrival wait ended within ARRIVAL_SPIN_S: only then does the next one spin that long (a peer
#: computing between steps makes every wait long, and its rounds come every few ms: 2 ms of spinning each
#: was ~10% of a core).
_arrivals_prompt = True

#: A wait for absent peers backs off with its age: it looks again (polls, or in the engine loop starts a round) at
#: most every LONG_WAIT_RATE * waited**2 seconds, up to LONG_WAIT_CAP_S: under the cycle time for waits of a few
#: hundred milliseconds (peers computing), seconds apart for peers that have not come for seconds (a stall: a rank
#: one step short, the others in a metric allreduce; each of its rounds is a full one, ~2.5 ms of CPU: re-checked
#: every millisecond, its engine threads took 54-78% of a core). A peer that comes after t seconds is seen at most
#: LONG_WAIT_RATE * t seconds late (2% of a 1 s absence).
LONG_WAIT_RATE = 0.02
#: The longest pause between two looks while peers are absent (well within presence.GRACE_S).
LONG_WAIT_CAP_S = 0.5

#: Per engine thread (a partial process set's members run its own engine): what runs between the polls of every
#: wait with the seconds waited so far, returning True to restart that count. The engine answers presence
#: probes there and gives up on a wait that a vanished peer holds.
_watches = threading.local()


def share_cores(ranks: int, cores: int) -> None:
    """Set how the engine's polls share the core: when this node runs more ranks than it has cores for
    (oversubscribed ranks progress only when the others give the core away), spinning yields often and stops
    after SPIN_POLLS even while a user thread waits; otherwise it yields rarely and goes on."""
    global YIELD_EVERY, EAGER_POLLS, _FINE_SLACK, _SPIN_WHILE_WAITED
    crowded = ranks > cores
    YIELD_EVERY = 8 if crowded else 256
    EAGER_POLLS = 0 if crowded else 16  # crowded: sleep at once, others need the core to progress
    _FINE_SLACK = not crowded  # crowded: the default slack batches wake-ups, which the others need too
    # crowded: a waiting user thread frees no core for this engine, so after SPIN_POLLS it backs off like any
    # wait. Spinning on took the core from the rank waited for: 3 ranks on 2 cores, rank 0 computing while two
    # waited, their CPU 25-30% of the wait before, 10% after; rank 0's time 1.98 -> 1.66 s (medians of 6).
    _SPIN_WHILE_WAITED = not crowded


def fine_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux rounds a sleeping thread's wake-up up by its timer
    slack (50 us by default), which would make every back-off sleep of the engine at least that long."""
    if not _FINE_SLACK:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)  # nanoseconds; this thread only
    except (OSError, AttributeError):  # not Linux: the platform's own timer behaviour stays
        pass


_PR_SET_TIMERSLACK = 29
_FINE_SLACK = True
_SPIN_WHILE_WAITED = True


class Polled:
    """A request that ``wait`` completes when ``Test()`` is true: a plane's own work, or DONE (a wrapped
    communicator's call that reduced before it returned: engine/deterministic.py, engine/accumulate.py)."""

    __slots__ = ("Test",)

    def __init__(self, test: Callable[[], bool]) -> None:
        self.Test = test


DONE = Polled(lambda: True)


def set_watch(watch: Optional[Callable[[float], bool]]) -> None:
    """The calling thread's watch (see _watches)."""
    _watches.watch = watch


def stalled_pause(waited: float) -> float:
    """How long to wait before looking again for peers that have been absent ``waited`` seconds."""
    return min(LONG_WAIT_CAP_S, LONG_WAIT_RATE * waited * waited)


def wait(request: Any, cap: float = POLL_CAP, arrival: bool = False) -> None:
    """Complete ``request``. While a user thread is blocked on a handle its core is idle, so poll
    continuously (on a crowded node only SPIN_POLLS times: the other ranks need the core); otherwise sleep
    between polls, backing off to ``cap`` seconds, so a training thread computing the backward pass keeps its
    core (and oversubscribed ranks still make progress).
    ``arrival``: the request completes when the peers arrive (a negotiation round), not when bytes have moved,
    so after ARRIVAL_SPIN_S it backs off on every node: a long wait there is a peer still computing, and spinning
    on would take the core (or the hyperthread beside it) that peer needs. 2 ranks on this 2-core machine, one
    computing ~1.3 s of Python while the other waited: the waiting rank's CPU 95-100% of the wait before. (Backing
    off after SPIN_POLLS alone, tens of microseconds, made a warm burst of 1,000 small ops 1.15x slower: its
    rounds' peers arrive within a millisecond.) It spins that long only when the last arrival wait ended within
    it: behind a peer still computing, every wait is long. A long arrival wait backs off further (stalled_pause).
    The engine's watch runs before each sleep (see set_watch)."""
    global _arrivals_prompt
    test = request.Test
    watch = getattr(_watches, "watch", None)
    started = began = time.monotonic()
    spin_for = ARRIVAL_SPIN_S if _arrivals_prompt else 0.0
    # spinning: continuously while a user thread waits; otherwise a few polls first, each yielding the
    # core (the training thread may need it), since an exchange with an active peer ends within microseconds
    spins, every = (SPIN_POLLS, YIELD_EVERY) if threads_waiting() else (EAGER_POLLS, 1)
    delay = 0.0
    while not test():
        if spins > 0:
            spins -= 1
            if spins % every == 0:
                time.sleep(0)  # give the core away if another process wants it (oversubscribed ranks)
            continue
        if watch is not None and watch(time.monotonic() - started):
            started = time.monotonic()
        if _SPIN_WHILE_WAITED and threads_waiting() and (
                not arrival or time.monotonic() - began < spin_for):
            spins, every, delay = SPIN_POLLS, YIELD_EVERY, 0.0
            continue
        longest = max(cap, stalled_pause(time.monotonic() - began)) if arrival else cap
        delay = min(longest, max(2e-5, delay * 2))
        time.sleep(delay)
    if arrival:
        _arrivals_prompt = time.monotonic() - began < ARRIVAL_SPIN_S
