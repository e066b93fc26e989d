"""Handles: the futures that asynchronous collectives return and that synchronize() waits on."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

_waiters = 0  # user threads blocked in wait(); while > 0 the engine may poll MPI without sleeping
_waiters_lock = threading.Lock()


def threads_waiting() -> bool:
    """True while some user thread is blocked on a handle (its core is idle, so polling is free)."""
    return _waiters > 0


class Handle:
    """The pending result of one collective. ``poll()`` / ``synchronize()`` take it."""

    __slots__ = ("name", "_event", "_result", "_error", "_finalize", "__weakref__")

    def __init__(self, name: str, finalize: Optional[Callable[[Any], Any]] = None) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._finalize = finalize

    def set_result(self, result: Any) -> None:
        self._result = result
        self._event.set()

    def set_error(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> Any:
        """Block until the collective finished; return its result or raise its error."""
        global _waiters
        if not self._event.is_set():
            with _waiters_lock:
                _waiters += 1
            try:
                while not self._event.wait(0.5):
                    pass
            finally:
                with _waiters_lock:
                    _waiters -= 1
        if self._error is not None:
            raise self._error
        if self._finalize is not None:
            self._result = self._finalize(self._result)
            self._finalize = None
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<hvdlite.Handle {self.name!r} {state}>"
