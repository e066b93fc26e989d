"""Per-rank wrapper of hvdlite-run: name the rank a signal kills, and copy the rank's output to files if asked.

README's "When a rank dies" says what it does. Run by path, not with ``-m`` (which would import numpy and mpi4py
into a process that lives as long as the rank): it imports only the standard library and
``hvdlite.core.launch_check``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import time
from types import FrameType, ModuleType
from typing import Any, Callable, Optional, Sequence

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # run by path: hvdlite/run/ must not shadow anything

#: Signals passed on to the program: how launchers, Slurm and a terminal stop, pause, resume or notify a job.
FORWARDED = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGTSTP", "SIGALRM", "SIGXCPU")
    if hasattr(signal, name))
#: Signals Python ignores at start-up; the program gets them back at their default, as subprocess does.
RESTORED = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name))
PR_SET_PDEATHSIG = 1


def launch_check() -> ModuleType:
    """``hvdlite.core.launch_check`` without running the packages' ``__init__.py`` (they import numpy and mpi4py)."""
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


def die_with_parent(signum: int = signal.SIGKILL, parent: Optional[int] = None) -> Callable[[], None]:
    """A function for a forked child: Linux sends it ``signum`` when its parent dies (``PR_SET_PDEATHSIG``), at
    once if ``parent`` died before that was armed."""
    try:
        import ctypes
        prctl: Optional[Callable[..., int]] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, ImportError):
        prctl = None

    def arm() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), signum)
    return arm


def _write(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode(errors="replace"))


def padded_rank(rank: int, size: Optional[int]) -> str:
    """The rank, zero-padded to the width of the largest rank (rank.03 of 12 ranks)."""
    width = len(str(max((size or 1) - 1, 0)))
    return str(rank).zfill(width)


def _forward(sources: dict[int, tuple[str, int, Optional[int]]], rank: int, stamp: bool) -> None:
    """Copy lines from each pipe (read fd -> stream name, console fd, file fd) until every pipe is closed."""
    pending = {fd: b"" for fd in sources}

    def emit(fd: int, data: bytes) -> None:
        name, console, file = sources[fd]
        if stamp:
            prefix = f"{time.strftime('%a %b %d %H:%M:%S %Y')}[{rank}]<{name}>:".encode()
            data = b"".join(prefix + line for line in data.splitlines(keepends=True))
        for target in (console, file):
            if target is not None:
                view = memoryview(data)
                while view:
                    try:
                        view = view[os.write(target, view):]
                    except OSError:
                        break

    while pending:
        ready, _, _ = select.select(list(pending), [], [])
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                if pending[fd]:
                    emit(fd, pending[fd])
                del pending[fd]
                continue
            data = pending[fd] + chunk
            cut = data.rfind(b"\n") + 1
            if cut:
                emit(fd, data[:cut])
            pending[fd] = data[cut:]


def redirect_output(directory: Optional[str], stamp: bool) -> None:
    """Point stdout and stderr at pipes to a forked forwarder that copies them to the console and the files."""
    rank, size = launch_check().launcher_rank()
    rank = 0 if rank is None else rank
    files: dict[str, Optional[int]] = {"stdout": None, "stderr": None}
    if directory:
        folder = os.path.join(directory, f"rank.{padded_rank(rank, size)}")
        os.makedirs(folder, exist_ok=True)
        for name in files:
            files[name] = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pipes = {name: os.pipe() for name in ("stdout", "stderr")}
    consoles = {"stdout": os.dup(1), "stderr": os.dup(2)}
    if os.fork() == 0:  # the forwarder: keep only its pipes, the console and the files
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # drain the program's last words after Ctrl-C
        keep = {pipes[n][0] for n in pipes} | set(consoles.values()) | {f for f in files.values() if f is not None}
        edges = sorted(keep)
        for low, high in zip([-1, *edges], [*edges, 65536]):  # every other fd, stdin, stdout and stderr included
            os.closerange(low + 1, high)
        try:
            _forward({pipes[n][0]: (n, consoles[n], files[n]) for n in pipes}, rank, stamp)
        finally:
            os._exit(0)
    for target, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(pipes[name][1], target)
    for fd in [*(fd for pair in pipes.values() for fd in pair), *consoles.values(),
               *(f for f in files.values() if f is not None)]:
        os.close(fd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -S sentinel.py", allow_abbrev=False)
    parser.add_argument("--dir", help="also write DIR/rank.<rank>/stdout and stderr")
    parser.add_argument("--timestamp", action="store_true", help="prefix each line with time, rank, stream")
    parser.add_argument("--exec", action="store_true", help="become the program instead of watching it")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the program to run after --")
    if args.dir or args.timestamp:
        redirect_output(args.dir, args.timestamp)
    if args.exec:
        _exec(command, lambda: None, ())
    state: dict[str, Any] = {"child": 0, "pending": [], "forwarded": set()}

    def forward(signum: int, _frame: Optional[FrameType]) -> None:
        state["forwarded"].add(signum)
        if state["child"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(state["child"], signum)
        else:
            state["pending"].append(signum)

    # a signal the launcher left ignored (nohup, a shell's background job) stays ignored for the program too
    caught = [sig for sig in FORWARDED if signal.getsignal(sig) != signal.SIG_IGN]
    for sig in caught:
        signal.signal(sig, forward)
    # the launcher's per-host daemon killed (kill -9 of the launcher) stops the program (SIGTERM, as forwarded)
    launcher_daemon = os.getppid()
    die_with_parent(signal.SIGTERM)()
    if os.getppid() != launcher_daemon:
        state["pending"].append(signal.SIGTERM)
        state["forwarded"].add(signal.SIGTERM)
    arm = die_with_parent(signal.SIGKILL, os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _exec(command, arm, caught)
    state["child"] = pid
    pending, state["pending"] = state["pending"], []
    for sig in pending:  # signals that arrived before the child existed
        forward(sig, None)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 1
    code = os.waitstatus_to_exitcode(status)
    host = os.uname().nodename
    if code < 0:
        if -code not in state["forwarded"]:
            _write(killed_message(rank_label(), pid, host, -code))
        return 128 - code
    if code != 0:
        _write(f"hvdlite-run: {rank_label()} (pid {pid} on host {host}) exited with code {code}")
    return code


def _exec(command: Sequence[str], arm: Callable[[], None], caught: Sequence[int]) -> None:
    """In the forked child (or, with --exec, instead of it): default signals, ``arm``, become the program."""
    try:
        for sig in (*caught, *RESTORED):
            signal.signal(sig, signal.SIG_DFL)
        arm()
        os.execvp(command[0], list(command))
    except OSError as exc:
        _write(f"hvdlite-run: {rank_label()}: cannot start {command[0]}: {exc.strerror}")
        os._exit(126 if isinstance(exc, PermissionError) else 127)
    finally:
        os._exit(127)


if __name__ == "__main__":
    sys.exit(main())
