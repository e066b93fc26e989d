"""Per-rank sentinel of hvdlite-run: run the rank's program as a child and name the rank if a signal kills it.

hvdlite-run puts ``python -S .../hvdlite/run/sentinel.py -- PROGRAM ARGS`` in front of every rank's program.
The program is forked (same argv, environment and open files: the launcher's PMI connection and the console
reach it unchanged), dies with the sentinel (``PR_SET_PDEATHSIG``), is stopped (SIGTERM) when the launcher's
daemon dies, and gets the signals launchers send. A death by a signal nobody forwarded (``kill -9``, the OOM
killer, a crash) and a non-zero exit are reported in one line naming the rank; the exit status passes on
(128+signal after a signal), so the launcher still stops the other ranks.

Run by path, not with ``-m``, which would import the ``hvdlite`` package (numpy, mpi4py) into a process that
lives as long as the rank: it imports only the standard library and ``hvdlite.core.launch_check``. Linux only
(elsewhere the program is simply not killed with a killed sentinel).
"""
from __future__ import annotations

import os
import signal
import sys
from types import FrameType, ModuleType
from typing import Any, Callable, Optional, Sequence

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run by path: hvdlite/run/ must not shadow anything

#: Signals passed on to the program: how mpiexec, mpirun, srun (and scancel --signal, Slurm's time limit,
#: a terminal) stop, pause, resume or notify a job. The sentinel itself keeps running; the program decides.
FORWARDED = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGTSTP", "SIGALRM", "SIGXCPU")
    if hasattr(signal, name))
#: Signals Python ignores at start-up; the program gets them back at their default, as subprocess does.
RESTORED = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name))
PR_SET_PDEATHSIG = 1


def launch_check() -> ModuleType:
    """``hvdlite.core.launch_check`` without running ``hvdlite/__init__.py`` and ``hvdlite/core/__init__.py``
    (they import numpy and mpi4py); within hvdlite (a test importing this module) it is the usual import."""
    import importlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, path in (("hvdlite", root), ("hvdlite.core", os.path.join(root, "core"))):
        if name not in sys.modules:
            package = ModuleType(name)
            package.__path__ = [path]
            sys.modules[name] = package
    return importlib.import_module("hvdlite.core.launch_check")


def rank_label() -> str:
    """``rank N`` as the launcher announced it (PMI, Open MPI, PMIx or Slurm), or ``the rank`` if none did."""
    rank, _ = launch_check().launcher_rank()
    return "the rank" if rank is None else f"rank {rank}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def killed_message(who: str, pid: int, host: str, signum: int) -> str:
    """The one line written when the program died of a signal nobody asked the job to stop with."""
    hint = (" (a SIGKILL nobody sent by hand is often the kernel's out-of-memory killer: see dmesg on that host)"
            if signum == signal.SIGKILL else "")
    return (f"hvdlite-run: {who} (pid {pid} on host {host}) was killed by signal {signum} ({signal_name(signum)})"
            f"; the launcher stops the other ranks because of it{hint}")


def exited_message(who: str, pid: int, host: str, code: int) -> str:
    return f"hvdlite-run: {who} (pid {pid} on host {host}) exited with code {code}"


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A function for a (forked) child that asks Linux to send it ``signum`` when its parent dies
    (``PR_SET_PDEATHSIG``); a no-op where prctl is unavailable."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError, ImportError):
        return lambda: None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    return arm


def _write(line: str) -> None:
    data = (line + "\n").encode(errors="replace")
    try:
        os.write(2, data)
    except OSError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[1:] if args[:1] == ["--"] else args
    if not command:
        _write("usage: python sentinel.py -- PROGRAM [ARGS...]")
        return 2
    state: dict[str, Any] = {"child": 0, "pending": [], "forwarded": set()}

    def forward(signum: int, _frame: Optional[FrameType]) -> None:
        state["forwarded"].add(signum)
        if state["child"]:
            try:
                os.kill(state["child"], signum)
            except ProcessLookupError:
                pass
        else:
            state["pending"].append(signum)

    # a signal the launcher left ignored (nohup, a shell's background job) stays ignored for the program too
    caught = [sig for sig in FORWARDED if signal.getsignal(sig) != signal.SIG_IGN]
    for sig in caught:
        signal.signal(sig, forward)
    # The launcher's per-host daemon (hydra's proxy, Open MPI's orted/prted, slurmstepd) killed without a
    # chance to clean up (kill -9 of the launcher) must not leave this rank running: its death stops the
    # program as the launcher would have (SIGTERM, forwarded like any stop signal).
    launcher_daemon = os.getppid()
    die_with_parent(signal.SIGTERM)()
    if os.getppid() != launcher_daemon:
        state["pending"].append(signal.SIGTERM)
        state["forwarded"].add(signal.SIGTERM)
    arm = die_with_parent()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _exec(command, parent, arm, caught)
    state["child"] = pid
    pending, state["pending"] = state["pending"], []
    for sig in pending:  # signals that arrived before the child existed
        forward(sig, None)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 1
    code = os.waitstatus_to_exitcode(status)
    host = os.uname().nodename
    if code < 0:
        if -code not in state["forwarded"]:
            _write(killed_message(rank_label(), pid, host, -code))
        return 128 - code
    if code != 0:
        _write(exited_message(rank_label(), pid, host, code))
    return code


def _exec(command: Sequence[str], parent: int, arm: Callable[[], None], caught: Sequence[int]) -> None:
    """In the forked child: default signal handling, die with the sentinel, become the program. Never returns."""
    try:
        for sig in (*caught, *RESTORED):
            signal.signal(sig, signal.SIG_DFL)
        arm()
        if os.getppid() != parent:  # the sentinel died before the death signal was armed
            os.kill(os.getpid(), signal.SIGKILL)
        os.execvp(command[0], list(command))
    except OSError as exc:
        _write(f"hvdlite-run: {rank_label()}: cannot start {command[0]}: {exc.strerror}")
        os._exit(126 if isinstance(exc, PermissionError) else 127)
    finally:
        os._exit(127)


if __name__ == "__main__":
    sys.exit(main())
