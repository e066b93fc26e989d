"""Run the launcher as a child, forward Ctrl-C/SIGTERM so every rank stops, and return the job's exit code."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any, Callable, Mapping, Sequence

from .sentinel import die_with_parent

#: Seconds the launcher gets to stop its ranks after a forwarded signal before it is killed.
GRACE_SECONDS = 15.0


def run(cmd: Sequence[str], env: Mapping[str, str], srun: bool = False) -> int:
    """Run ``cmd`` in its own session; return its exit code (128+N when it or the job died of signal N, whatever
    the launcher says). A signal is forwarded: SIGTERM to srun (SIGINT only makes it print the step's state),
    SIGINT to mpiexec/mpirun; a second one, or a launcher alive ``GRACE_SECONDS`` later, kills its process group.
    The launcher gets SIGTERM if hvdlite-run dies (``PR_SET_PDEATHSIG``)."""
    proc = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True, preexec_fn=stop_with(os.getpid()))
    received: list[tuple[int, float]] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append((signum, time.monotonic()))
        if len(received) == 1:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM if srun or signum == signal.SIGTERM else signal.SIGINT)
        else:
            kill_group(proc.pid)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if received and time.monotonic() - received[0][1] > GRACE_SECONDS:
                    kill_group(proc.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        kill_group(proc.pid)  # ranks the interrupted launcher left behind in its session
        return 128 + received[0][0]
    if code < 0:
        return 128 - code
    return code


def stop_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` for a launcher started by ``parent``: SIGTERM it when ``parent`` dies."""
    return die_with_parent(signal.SIGTERM, parent)


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (a launcher and the ranks it left in its session), if it exists."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
