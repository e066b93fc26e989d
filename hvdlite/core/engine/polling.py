"""Waiting on MPI requests without taking the core that the training thread needs."""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Sized

from .handles import threads_waiting

POLL_CAP = 1e-4  # the longest sleep between polls of a data collective while the training thread computes
SPIN_POLLS = 200  # MPI polls without sleeping while a user thread waits (a few tens of microseconds)
YIELD_EVERY = 8  # while spinning, yield the core every this many polls (share_cores: often when oversubscribed)
#: Polls (each yielding the core) before the first sleep when no user thread waits: an exchange with an active
#: peer ends within microseconds, and the shortest sleep costs tens of them.
EAGER_POLLS = 16
#: How long an arrival wait (a negotiation round) spins while a user thread waits on an uncrowded node: a burst's
#: peers arrive within it; a peer still computing takes far longer and needs its core.
ARRIVAL_SPIN_S = 0.002
_arrivals_prompt = True  # whether the last arrival wait ended within ARRIVAL_SPIN_S: only then the next spins
#: A wait for absent peers looks again at most every LONG_WAIT_RATE * waited**2 s, up to LONG_WAIT_CAP_S (within
#: stalls.GRACE_S): a peer that comes after t seconds is seen at most LONG_WAIT_RATE * t seconds late.
LONG_WAIT_RATE = 0.02
LONG_WAIT_CAP_S = 0.5
#: Per engine thread: what runs between the polls of every wait with the seconds waited so far (answering presence
#: probes, giving up on a wait a vanished peer holds); True restarts that count.
_watches = threading.local()


def share_cores(ranks: int, cores: int) -> None:
    """Set how the engine's polls share the core: where this node runs more ranks than it has cores for (CROWDED:
    the ranks progress only when the others give the core away), spinning yields often and stops after SPIN_POLLS
    even while a user thread waits, and wake-ups keep the default timer slack; otherwise it yields rarely."""
    global YIELD_EVERY, EAGER_POLLS, CROWDED
    CROWDED = ranks > cores
    YIELD_EVERY = 8 if CROWDED else 256
    EAGER_POLLS = 0 if CROWDED else 16  # crowded: sleep at once, others need the core to progress


def fine_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux rounds a sleeping thread's wake-up up by its timer
    slack (50 us by default), which would make every back-off sleep of the engine at least that long."""
    if CROWDED:
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the platform's own timer behaviour stays
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)  # nanoseconds; this thread only


_PR_SET_TIMERSLACK = 29
CROWDED = False  # more ranks on this node than cores for them (share_cores)
#: On a crowded node the engine's wait for the rest of a burst (Burst) ends once the process's other threads ran
#: BURST_CPU_S of CPU without submitting (a burst's submissions come tens of microseconds of CPU apart; a thread
#: descheduled mid-burst runs none, so not on the clock), or none came for BURST_QUIET_S (they sleep in user code).
BURST_CPU_S = 0.001
BURST_QUIET_S = 0.02  # above a descheduled thread's usual wait for a core on a crowded node


class Polled(NamedTuple):
    """A request that ``wait`` completes when ``Test()`` is true: a plane's own work, or DONE (already reduced)."""

    Test: Callable[[], bool]


DONE = Polled(lambda: True)


class Burst:
    """``over()``: whether a crowded engine's wait for the rest of a burst of submissions into ``queue`` ends (see
    BURST_CPU_S), a user thread blocks on a handle, or ``longest`` seconds passed."""

    def __init__(self, queue: Sized, longest: float) -> None:
        self.queue = queue
        self.seen = -1  # the queue's length at the last submission seen,
        self.at = 0.0  # when it was seen,
        self.ran = 0.0  # and the CPU time of this thread's peers then
        self.end = time.monotonic() + longest

    def over(self) -> bool:
        now, others = time.monotonic(), time.process_time() - time.thread_time()  # (the CPU of this thread's peers)
        if len(self.queue) != self.seen:
            self.seen, self.at, self.ran = len(self.queue), now, others
        return threads_waiting() or now > self.end or others - self.ran > BURST_CPU_S or now - self.at > BURST_QUIET_S


def set_watch(watch: Optional[Callable[[float], bool]]) -> None:
    _watches.watch = watch


def stalled_pause(waited: float) -> float:
    """How long to wait before looking again for peers that have been absent ``waited`` seconds."""
    return min(LONG_WAIT_CAP_S, LONG_WAIT_RATE * waited * waited)


def wait(request: Any, cap: float = POLL_CAP, arrival: bool = False) -> None:
    """Complete ``request``. While a user thread is blocked on a handle its core is idle, so poll continuously
    (on a crowded node only SPIN_POLLS times); otherwise sleep between polls, backing off to ``cap`` seconds,
    so a training thread computing keeps its core. ``arrival`` (a negotiation round): spin only ARRIVAL_SPIN_S,
    then back off further as it ages (stalled_pause): a peer still computing needs its core. The watch runs
    before each sleep."""
    global _arrivals_prompt
    test = request.Test
    watch = getattr(_watches, "watch", None)
    started = began = time.monotonic()
    spin_for = ARRIVAL_SPIN_S if _arrivals_prompt else 0.0
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
        if not CROWDED and threads_waiting() and (
                not arrival or time.monotonic() - began < spin_for):
            spins, every, delay = SPIN_POLLS, YIELD_EVERY, 0.0
            continue
        longest = max(cap, stalled_pause(time.monotonic() - began)) if arrival else cap
        delay = min(longest, max(2e-5, delay * 2))
        time.sleep(delay)
    if arrival:
        _arrivals_prompt = time.monotonic() - began < ARRIVAL_SPIN_S
