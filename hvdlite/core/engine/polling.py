"""Waiting on MPI requests without taking the core that the training thread needs."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from .handles import threads_waiting

#: MPI polls without sleeping while a user thread waits (a few tens of microseconds).
SPIN_POLLS = 200

_serve: Optional[Callable[[], None]] = None  # runs between polls of every wait (the engine's probe answers)


def set_server(serve: Optional[Callable[[], None]]) -> None:
    """Run ``serve`` between the polls of every wait (the engine answers presence probes, so that a peer
    whose round is stuck can tell a rank that is busy in a long collective from one that is gone)."""
    global _serve
    _serve = serve


def wait(request: Any, cap: float, between: Optional[Callable[[], None]] = None) -> None:
    """Complete ``request``. While a user thread is blocked on a handle its core is idle, so poll
    continuously; otherwise sleep between polls, backing off to ``cap`` seconds, so a training thread
    computing the backward pass keeps its core (and oversubscribed ranks still make progress).
    ``between`` runs before each sleep (the engine answers presence probes there, or gives up)."""
    test = request.Test
    between = between or _serve
    spins = SPIN_POLLS if threads_waiting() else 0
    delay = 0.0
    while not test():
        if between is not None and spins == 0:
            between()
        if spins > 0:
            spins -= 1
            continue
        if threads_waiting():
            spins, delay = SPIN_POLLS, 0.0
            continue
        delay = min(cap, max(2e-5, delay * 2))
        time.sleep(delay)
