"""Run the launcher as a child, forward Ctrl-C/SIGTERM so every rank stops, and return the job's exit code."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Mapping, Sequence

#: Seconds the launcher gets to stop its ranks after a forwarded signal before it is killed.
GRACE_SECONDS = 15.0


def run(cmd: Sequence[str], env: Mapping[str, str], srun: bool = False) -> int:
    """Run ``cmd``; return its exit code (128+N when it died of signal N).

    The launcher runs in its own session, so a terminal's Ctrl-C reaches only hvdlite-run, which forwards
    it: SIGINT to mpiexec/mpirun (they pass it to every rank and stop the job), SIGTERM to srun (one
    SIGINT only makes srun print the step's state). A second signal, or a launcher still alive
    ``GRACE_SECONDS`` later, gets SIGKILL for the launcher's whole process group.
    """
    proc = subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
    received: list[tuple[int, float]] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append((signum, time.monotonic()))
        if len(received) == 1:
            _signal(proc, signal.SIGTERM if srun or signum == signal.SIGTERM else signal.SIGINT)
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
    if code < 0:
        return 128 - code
    if received and code == 0:
        return 128 + received[0][0]
    return code


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (a launcher and the ranks it left in its session), if it exists."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
