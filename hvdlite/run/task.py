"""Rank side of ``hvdlite.run``: fetch the pickled function, call it, send back its result or exception.

Run as ``python -m hvdlite.run.task ADDRESSES PORT`` by the launcher; the key comes in HVDLITE_RUN_FUNC_KEY.
"""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any, Sequence

from ..core.launch import getenv, launcher_rank
from .func import KEY_VARIABLE


def _request(addresses: Sequence[str], port: int, key: bytes, message: tuple[Any, ...]) -> bytes:
    problems = []
    for address in addresses:
        try:
            conn = Client((address, port), authkey=key)
        except OSError as exc:
            problems.append(f"{address}:{port}: {exc}")
            continue
        try:
            conn.send_bytes(pickle.dumps(message))
            return conn.recv_bytes()
        finally:
            conn.close()
    raise ConnectionError("cannot reach the hvdlite.run caller at " + "; ".join(problems))


def _abort_if_mpi() -> None:
    """Stop the other ranks too (they may wait for this one in a collective)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(1)


def main(argv: Sequence[str]) -> int:
    addresses, port = argv[0].split(","), int(argv[1])
    key = bytes.fromhex(getenv(KEY_VARIABLE) or "")
    rank, _ = launcher_rank()
    rank = 0 if rank is None else rank
    func, args, kwargs = pickle.loads(_request(addresses, port, key, ("get", rank)))
    try:
        value: Any = func(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        text = traceback.format_exc()
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)
        except Exception:  # noqa: BLE001 - exceptions that do not survive pickling travel as text
            data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
        _request(addresses, port, key, ("result", rank, "error", data, text))
        sys.stderr.write(f"hvdlite.run: rank {rank}: {text}")
        sys.stderr.flush()
        _abort_if_mpi()
        os._exit(1)
    import cloudpickle
    _request(addresses, port, key, ("result", rank, "ok", cloudpickle.dumps(value), ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
