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
    """Run ``cmd``; return its exit code (128+N when it died of signal N).

    The launcher runs in its own session, so a terminal's Ctrl-C reaches only hvdlite-run, which forwards
    it: SIGINT to mpiexec/mpirun (they pass it to every rank and stop the job), SIGTERM to srun (one
    SIGINT only makes srun print the step's state). A second signal, or a launcher still alive
    ``GRACE_SECONDS`` later, gets SIGKILL for the launcher's whole process group. A job stopped by a
    signal exits 128+N whatever the launcher returns (Open MPI's mpirun says 1): 130 for Ctrl-C, 143 for
    SIGTERM, under every launcher.

    hvdlite-run itself killed without a chance to forward anything (``kill -9``, a timeout's SIGKILL) still
    takes its job with it: Linux sends the launcher SIGTERM when hvdlite-run dies (``PR_SET_PDEATHSIG``),
    and the launcher stops its ranks as on any SIGTERM (the per-rank sentinels do the same if the
    launcher's own daemons die).
    """
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
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
