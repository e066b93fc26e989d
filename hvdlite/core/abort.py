"""The abort-on-error excepthook: an uncaught exception on one rank ends the whole job, after its traceback."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from .engine import callsite, mpi
from .engine.loop import LOST_RANKS_WAIT_S
from .errors import lost_rank

_previous_excepthook: Any = None
_previous_threading_hook: Any = None
_ABORT_GRACE_S = 1.0  # seconds between printing an uncaught exception and MPI_Abort
#: After a rank's death under ULFM the survivors learn of it at different times and each takes up to
#: LOST_RANKS_WAIT_S to name the dead rank: the first one's abort waits so every survivor's error names it.
_LOST_RANK_GRACE_S = LOST_RANKS_WAIT_S + _ABORT_GRACE_S
#: A second SIGINT this soon after the first is the same Ctrl-C forwarded again (by the launcher and the
#: sentinel): dropped, so it cannot interrupt the first one's exit ("Error in sys.excepthook").
_SIGINT_REPEAT_S = 2.0
_first_sigint = 0.0


def install_excepthook(current: Callable[[], Any]) -> None:
    """On an uncaught exception in any thread, print it, then abort the whole job (the other ranks would wait
    for this one forever). Hooks installed before hvdlite's run first. ``current()``: the live State or None."""
    global _previous_excepthook, _previous_threading_hook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook
    _previous_threading_hook = threading.excepthook

    def abort_job(exc_type: Any, exc: BaseException, tb: Any, thread: str = "") -> None:
        state = current()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        where = f" in thread {thread}" if thread else ""
        sys.stderr.write(f"[hvdlite rank {state.rank if state else '?'}] uncaught exception{where}; aborting "
                         f"the whole job so other ranks do not wait for this one:\n{text}")
        sys.stderr.flush()
        if state is not None and state.size > 1 and not issubclass(exc_type, KeyboardInterrupt):
            # The launcher forwards this rank's output and its abort request on separate channels; when
            # the abort wins, the traceback above can be lost. Give the output a moment to get through.
            time.sleep(_LOST_RANK_GRACE_S if lost_rank(exc, state.engine.error) else _ABORT_GRACE_S)
            mpi.abort(1)
            # MPICH's MPI_Abort can return while the launcher tears the job down; exiting through the
            # interpreter would run hvdlite's shutdown and bury this error under "shut down" on the peers.
            os._exit(1)

    def main_thread_hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            interrupted(current(), tb)
        if _previous_excepthook not in (None, sys.__excepthook__):
            _previous_excepthook(exc_type, exc, tb)
        abort_job(exc_type, exc, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_type is SystemExit:
            return
        if _previous_threading_hook not in (None, threading.__excepthook__):
            _previous_threading_hook(args)
        abort_job(args.exc_type, args.exc_value, args.exc_traceback,
                  args.thread.name if args.thread is not None else "?")

    sys.excepthook = main_thread_hook
    threading.excepthook = thread_hook
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a script's own handler stays
        signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: Any) -> None:
    """Python's Ctrl-C (KeyboardInterrupt), once per burst of forwarded copies of the same SIGINT."""
    global _first_sigint
    now = time.monotonic()
    if _first_sigint and now - _first_sigint < _SIGINT_REPEAT_S:
        return
    _first_sigint = now
    raise KeyboardInterrupt


def users_line(tb: Any) -> str:
    """``file:line`` of the innermost frame of ``tb`` that is the user's own, else of the innermost frame."""
    every = list(traceback.extract_tb(tb))
    frame = next((f for f in reversed(every) if callsite.is_users(f.filename)), every[-1])
    return f"{frame.filename}:{frame.lineno}"


def interrupted(state: Any, tb: Any) -> None:
    """Ctrl-C stopped this rank: say so in one line (no traceback per rank) and end the process by SIGINT, as
    Python does (status 130), ignoring further SIGINTs; no shutdown: every rank is stopping."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    where = f" at {users_line(tb)}" if tb is not None else ""
    with contextlib.suppress(OSError, ValueError):  # a closed console must not keep the rank alive
        sys.stdout.flush()
        sys.stderr.write(f"[hvdlite rank {state.rank if state else '?'}] interrupted (KeyboardInterrupt{where}); "
                         f"stopping\n")
        sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # not reached: the default SIGINT action ends the process
