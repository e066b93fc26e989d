"""What the elastic driver (hvdlite-run) and its ranks share: the variables it sets in the ranks, how a rank signs
its messages, and where the ranks keep their commits; run by path on a host (remover_command), with the standard
library only, it deletes that host's commit of a run."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

DRIVER_VARIABLE = "HVDLITE_ELASTIC_DRIVER"
JOB_VARIABLE = "HVDLITE_ELASTIC_JOB"
RESTART_VARIABLE = "HVDLITE_ELASTIC_RESTART"
GENERATION_VARIABLE = "HVDLITE_ELASTIC_GENERATION"
SECRET_VARIABLE = "HVDLITE_ELASTIC_SECRET"
#: hvdlite-run's --min-np: survivors of an in-process recovery fewer than it leave instead of training on.
MIN_NP_VARIABLE = "HVDLITE_ELASTIC_MIN_NP"
STANDBY_VARIABLE = "HVDLITE_ELASTIC_STANDBY"  # a standby job's ranks: they wait until the driver hands the run over


def signature(secret: str, nonce: str, message: dict[str, Any]) -> str:
    """The HMAC-SHA256 (hex) of ``message`` (without its "mac") on the connection that sent ``nonce``."""
    body = json.dumps({k: v for k, v in message.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret.encode(), f"{nonce}\n{body}".encode(), hashlib.sha256).hexdigest()


def job_dir(configured: str, job: str) -> Path:
    """``<dir>/hvdlite-elastic-<job>`` (dir: the configured one, else /dev/shm if writable, else the temp dir): one
    ``<hostname>`` directory per host that wrote a commit in it."""
    if not re.fullmatch(r"[0-9A-Za-z_-]+", job):
        raise ValueError(f"not an elastic run id: {job!r}")
    shm = Path("/dev/shm")
    base = configured or (shm if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir())
    return Path(base) / f"hvdlite-elastic-{job}"


def remove_job(configured_dir: str, job: str) -> None:
    """Delete every host's commit of run ``job`` on this machine (the driver, when the run ends)."""
    shutil.rmtree(job_dir(configured_dir, job), ignore_errors=True)


def remove_host(configured: str, job: str) -> None:
    """Delete this host's commit of run ``job``, then the run's directory if no other host's copy is left in it
    (a shared file system); OSError for what cannot go."""
    top = job_dir(configured, job)
    mine = top / socket.gethostname()
    if mine.exists() or mine.is_symlink():
        shutil.rmtree(mine)
    try:
        top.rmdir()
    except OSError:  # gone already, or another host's copy is left in it
        if top.exists() and not any(top.iterdir()):
            raise


def remover_command(python: str, configured: str, job: str) -> list[str]:
    """The command that runs remove_host on the host it is started on (each argument one word, no shell)."""
    return [python, "-I", "-S", os.path.abspath(__file__), configured, job]


if __name__ == "__main__":
    try:
        remove_host(sys.argv[1], sys.argv[2])
    except (OSError, ValueError, IndexError) as exc:
        sys.exit(f"hvdlite: {socket.gethostname()}: elastic commits not removed: {exc}")
