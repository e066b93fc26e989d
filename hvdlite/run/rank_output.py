"""Per-rank output for hvdlite-run: ``--output-filename DIR`` files and ``--prefix-output-with-timestamp``.

hvdlite-run puts ``python -m hvdlite.run.rank_output [--dir DIR] [--timestamp] -- PROGRAM ARGS`` in front of
the program, so the same thing happens under mpiexec, mpirun and srun. This process forks a small forwarder,
points its own stdout/stderr at pipes to it, and then *becomes* the program (exec): the program keeps this
process id, its environment and the launcher's connections. The forwarder copies every line to the
console (with ``<time>[rank]<stdout>:`` in front when --timestamp) and, with --dir, to
``DIR/rank.<rank>/stdout`` and ``.../stderr`` (rank zero-padded so the names sort, as horovodrun).
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from typing import Optional, Sequence

from ..core.launch import launcher_rank


def rank_label(rank: int, size: Optional[int]) -> str:
    """The rank, zero-padded to the width of the largest rank (rank.03 of 12 ranks)."""
    width = len(str(max((size or 1) - 1, 0)))
    return str(rank).zfill(width)


def timestamp_prefix(rank: int, stream: str) -> bytes:
    return f"{time.strftime('%a %b %d %H:%M:%S %Y')}[{rank}]<{stream}>:".encode()


def _forward(sources: dict[int, tuple[str, int, Optional[int]]], rank: int, stamp: bool) -> None:
    """Copy lines from each pipe (read fd -> stream name, console fd, file fd) until every pipe is closed."""
    pending = {fd: b"" for fd in sources}

    def emit(fd: int, data: bytes) -> None:
        name, console, file = sources[fd]
        if stamp:
            data = b"".join(timestamp_prefix(rank, name) + line for line in data.splitlines(keepends=True))
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdlite.run.rank_output", allow_abbrev=False)
    parser.add_argument("--dir", help="write DIR/rank.<rank>/stdout and stderr")
    parser.add_argument("--timestamp", action="store_true", help="prefix each line with time, rank, stream")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the program to run after --")
    rank, size = launcher_rank()
    rank = 0 if rank is None else rank
    files: dict[str, Optional[int]] = {"stdout": None, "stderr": None}
    if args.dir:
        folder = os.path.join(args.dir, f"rank.{rank_label(rank, size)}")
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
        for fd in range(3, max(keep) + 1):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.closerange(max(keep) + 1, 65536)
        os.close(0)
        os.close(1)
        os.close(2)
        try:
            _forward({pipes[n][0]: (n, consoles[n], files[n]) for n in pipes}, rank, args.timestamp)
        finally:
            os._exit(0)
    for target, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(pipes[name][1], target)
    for fd in [*(fd for pair in pipes.values() for fd in pair), *consoles.values(),
               *(f for f in files.values() if f is not None)]:
        os.close(fd)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        os.write(2, f"hvdlite-run: rank {rank}: cannot start {command[0]}: {exc.strerror}\n".encode())
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
