"""``elastic.run``: the wrapper around an elastic training function (sync at start, resize on host changes)."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

from ..log import logger
from . import link as driver
from .state import HostsUpdatedInterrupt, State

F = TypeVar("F", bound=Callable[..., Any])

#: Exit code of a rank that leaves because the job is resizing (the driver is also told by message).
RESIZE_EXIT_CODE = 75


def run(func: F) -> F:
    """Decorate ``func(state, *args, **kwargs)`` for elastic training (Horovod's ``hvd.elastic.run``).

    At every start of the job the ranks sync the state (newest commit anywhere, see State.sync) and,
    after a restart, run the reset callbacks. MPI cannot change a running job's size, so a host change
    (HostsUpdatedInterrupt, raised by commit() on every rank at once) ends this process with
    RESIZE_EXIT_CODE and hvdlite-run starts the job again at its new size; a lost rank makes the
    collectives fail and the driver restarts the job on the healthy hosts. Either way the state comes
    back from the last commit. Without an elastic driver it simply syncs and calls ``func``.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        from .. import runtime
        lk = driver.link()
        lk.connect(runtime.rank(), runtime.size())
        state.sync()
        restarts = driver.restart_count()
        if restarts > 0:
            logger.info("restart %d: running the reset callbacks at size %d", restarts, runtime.size())
            state.on_reset()
        try:
            result = func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            logger.info("hosts changed: leaving at commit %d so the job restarts at its new size",
                        state.commit_counter)
            lk.send(op="resize", commit=state.commit_counter)
            runtime.shutdown()
            lk.close()
            sys.exit(RESIZE_EXIT_CODE)
        lk.send(op="done")
        state.finish()
        return result

    return wrapper  # type: ignore[return-value]
