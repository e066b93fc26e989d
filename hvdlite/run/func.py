"""``hvdlite.run(fn, args, kwargs, num_proc/np, hosts, ...)``: Horovod's programmatic launch.

A key-authenticated server in this process hands the cloudpickled function to the ranks (``hvdlite.run.task``,
started as hvdlite-run starts a program) and collects their results (README, "hvdlite.run").
"""
from __future__ import annotations

import contextlib
import linecache
import os
import pickle
import re
import secrets
import socket
import sys
import threading
from multiprocessing.connection import Listener
from typing import Any, Callable, Optional, Sequence

from ..core.launch import environ

#: Environment variable carrying the server's secret key to the ranks.
KEY_VARIABLE = "HVDLITE_RUN_FUNC_KEY"


class RankError(RuntimeError):
    """The traceback of an exception raised in a rank (the ``__cause__`` of the re-raised exception)."""


class _Server:
    """Hands out the pickled function and collects each rank's outcome."""

    def __init__(self, payload: bytes, key: bytes) -> None:
        self.payload = payload
        self.results: dict[int, tuple[str, bytes, str]] = {}
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        self.port = self.listener.address[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="hvdlite.run server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn = self.listener.accept()
            except Exception:  # noqa: BLE001 - a failed handshake (wrong key) or the listener closed
                continue
            try:
                request = pickle.loads(conn.recv_bytes())
                if request[0] == "get":
                    conn.send_bytes(self.payload)
                elif request[0] == "result":
                    _, rank, status, data, text = request
                    self.results[int(rank)] = (status, data, text)
                    conn.send_bytes(b"ok")
            except Exception:  # noqa: BLE001 - one broken rank connection must not stop the others
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", self.port), timeout=5).close()  # wake accept()
        self._thread.join(timeout=10)
        self.listener.close()


def _addresses() -> list[str]:
    """Addresses of this host the ranks may reach the server on, most specific first."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        found += socket.gethostbyname_ex(socket.gethostname())[2]
    found.append("127.0.0.1")
    return list(dict.fromkeys(a for a in found if a))


def _flags(**options: Any) -> list[str]:
    flags: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [f"{flag}={value}"]
    return flags


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None,
        num_proc: Optional[int] = None, min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None, cooldown_range: Any = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None, start_timeout: Optional[int] = None,
        ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None,
        disable_cache: Optional[bool] = None, output_filename: Optional[str] = None,
        verbose: Optional[bool] = None, use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        executable: Optional[str] = None, np: Optional[int] = None, min_np: Optional[int] = None,
        max_np: Optional[int] = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` in ``num_proc`` (or ``np``) hvdlite processes; return each rank's return
    value, in rank order. Horovod's ``horovod.run`` signature; the elastic arguments (use hvdlite-run's
    elastic flags) and ``use_gloo`` are refused."""
    import cloudpickle

    from .__main__ import plan_launch
    from .args import GLOO_ROLE, parse_args
    from .commands import build_command, child_environment, format_command
    from .launchers import SRUN
    from .process import run as run_process

    if num_proc is not None and np is not None and num_proc != np:
        raise ValueError(f"hvdlite.run: num_proc={num_proc} and np={np} disagree; give one of them")
    count = num_proc if num_proc is not None else np if np is not None else 1
    elastic = {"min_num_proc": min_num_proc, "max_num_proc": max_num_proc, "slots": slots,
               "reset_limit": reset_limit, "cooldown_range": cooldown_range, "min_np": min_np, "max_np": max_np}
    given = [name for name, value in elastic.items() if value is not None]
    if given:
        raise ValueError(f"hvdlite.run: {', '.join(given)}: no elastic form: use hvdlite-run --min-np/--max-np")
    if hosts is not None and hostfile is not None:
        raise ValueError("hvdlite.run: give hosts or hostfile, not both")
    if use_gloo:
        raise ValueError(f"hvdlite.run(use_gloo=True): {GLOO_ROLE}. Drop use_gloo=True")
    key = secrets.token_bytes(32)
    payload = cloudpickle.dumps((func, tuple(args), dict(kwargs or {})))
    server = _Server(payload, key)
    try:
        python = executable or sys.executable
        task = [python, "-m", "hvdlite.run.task", ",".join(_addresses()), str(server.port)]
        argv = ["-np", str(count)] + _flags(hosts=hosts, hostfile=hostfile, start_timeout=start_timeout,
                                             ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
                                             disable_cache=disable_cache, output_filename=output_filename,
                                             verbose=verbose, mpi_args=mpi_args,
                                             network_interfaces=network_interface)
        cli = parse_args(argv + ["--", *task])
        env = dict(environ())
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, [*env.get("PYTHONPATH", "").split(
            os.pathsep), *_importable_paths()])))
        launcher, plan, warnings = plan_launch(cli, env)
        plan.extra_env[KEY_VARIABLE] = key.hex()
        child_env = child_environment(env, plan, launcher)
        cmd = build_command(launcher, plan, child_env)
        from ..core.launch import logger
        for warning in warnings:
            logger.warning("hvdlite.run: %s", warning)
        if verbose:
            logger.warning("hvdlite.run: running %s", format_command(cmd, {}))
        code = run_process(cmd, child_env, srun=launcher.kind == SRUN)
    finally:
        server.close()
    return _collect(server.results, count, code, getattr(getattr(func, "__code__", None), "co_filename", ""))


def _importable_paths() -> list[str]:
    """This process's import path beyond the interpreter's own, so ranks import what the caller imports."""
    roots = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    return [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p) and not os.path.abspath(p).startswith(roots)]


_DYNAMIC_FRAME = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+), in (.+)$', re.M)


def _restore_source(text: str, source: str) -> str:
    """Put the caller's file and source lines back into a rank's traceback: cloudpickle (3.1.3 and later) names
    the code of a function it pickled by value ``<dynamic-code>``, keeping its line numbers."""
    if not source or not os.path.isfile(source):
        return text

    def frame(match: "re.Match[str]") -> str:
        indent, line, name = match.group(1), int(match.group(2)), match.group(3)
        code = linecache.getline(source, line).strip()
        return f'{indent}File "{source}", line {line}, in {name}' + (f"\n{indent}  {code}" if code else "")
    return _DYNAMIC_FRAME.sub(frame, text)


def _collect(results: dict[int, tuple[str, bytes, str]], count: int, code: int, source: str = "") -> list[Any]:
    errors = sorted(rank for rank, (status, _, _) in results.items() if status == "error")
    if errors:
        rank = errors[0]
        _, data, text = results[rank]
        text = _restore_source(text, source)
        try:
            exc = pickle.loads(data)
        except Exception:  # noqa: BLE001 - an exception type the caller cannot unpickle
            exc = RuntimeError(text.strip().splitlines()[-1] if text.strip() else "unknown error")
        if not isinstance(exc, BaseException):
            exc = RuntimeError(str(exc))
        others = f" (ranks {', '.join(map(str, errors[1:]))} failed too)" if errors[1:] else ""
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on rank {rank} of {count} in hvdlite.run{others}")
        raise exc from RankError(f"rank {rank} of {count}:\n{text}")
    missing = [rank for rank in range(count) if rank not in results]
    if missing or code != 0:
        which = f"ranks {', '.join(map(str, missing))} returned no result" if missing else "every rank returned"
        raise RuntimeError(f"hvdlite.run: the job exited with code {code} and {which}; see the ranks' output "
                           f"above")
    return [pickle.loads(results[rank][1]) for rank in range(count)]
