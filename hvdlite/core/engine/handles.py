"""Handles: the futures that asynchronous collectives return and that synchronize() waits on."""
from __future__ import annotations

import operator
import threading
from typing import Any, Callable, Optional

_blocked = 0  # user threads blocked in wait(); while > 0 the engine may poll MPI without sleeping
_blocked_lock = threading.Lock()


def threads_waiting() -> bool:
    """True while some user thread is blocked on a handle (its core is idle, so polling is free)."""
    return _blocked > 0


UNSET = object()  # no value set by returning(): wait() returns the (finalized) result
_FIRST = operator.itemgetter(0)  # one shared callable: first() adds no object per op


class Handle:
    """The pending result of one collective. A thread that must block makes its own lock (most handles are done
    before anyone waits): it registers the lock, then re-checks ``done``; completion sets ``done``, then releases
    every registered lock. Either order of the two wakes the waiter."""

    __slots__ = ("name", "_waiters", "_done", "_result", "_error", "_finalize", "_value", "__weakref__")
    # Set by the one kind of handle there is, engine/requests.py's Request (a request is its own handle).
    name: str
    _waiters: Optional[list[Any]]
    _done: bool
    _result: Any
    _error: Optional[BaseException]
    _finalize: Optional[Callable[[Any], Any]]
    _value: Any  # what wait() returns once the op succeeded (see returning()), else UNSET

    def settle(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        """Complete the handle with ``result``, or with ``error`` when one is given (once: later calls do nothing)."""
        if not self._done:
            self._result, self._error, self._done = result, error, True
            waiters = self._waiters
            if waiters:
                for lock in list(waiters):
                    lock.release()

    def done(self) -> bool:
        return self._done

    def reads_result(self) -> bool:
        """Whether wait() will look at the result (not when returning() set what it returns)."""
        return self._finalize is not None or self._value is UNSET

    def wait(self) -> Any:
        """Block until the collective finished; return its result or raise its error."""
        global _blocked
        if not self._done:
            lock = threading.Lock()
            lock.acquire()
            with _blocked_lock:
                _blocked += 1
                if self._waiters is None:
                    self._waiters = []
                self._waiters.append(lock)
            try:
                while not self._done and not lock.acquire(timeout=0.5):
                    pass
            finally:
                with _blocked_lock:
                    _blocked -= 1
                    self._waiters.remove(lock)
        if self._error is not None:
            raise self._error
        if self._finalize is not None:
            self._result = self._finalize(self._result)
            self._finalize = None
        return self._result if self._value is UNSET else self._value

    __call__ = wait  # Horovod's torch sparse_allreduce_async returns a function that waits: its handle is called

    def returning(self, value: Any) -> "Handle":
        """Make ``wait()`` return ``value`` once the op succeeded (after any conversion already set); returns self."""
        self._value = value
        return self

    def then(self, convert: Callable[[Any], Any]) -> "Handle":
        """Make ``wait()`` return ``convert(result)`` (after any conversion already set); returns self."""
        if self._value is not UNSET:
            value, self._value, earlier = self._value, UNSET, self._finalize
            self._finalize = (lambda result: (earlier(result), value)[1]) if earlier else (lambda result: value)
        inner = self._finalize
        self._finalize = (lambda result: convert(inner(result))) if inner else convert
        return self

    def first(self) -> "Handle":
        """Make ``wait()`` return the first result of a grouped request (a request of one tensor); returns self."""
        return self.then(_FIRST)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<hvdlite.Handle {self.name!r} {state}>"
