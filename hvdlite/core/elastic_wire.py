"""What the elastic driver (hvdlite-run) and its ranks share: the variables it sets in the ranks, how a rank
signs its messages (see ``hvdlite.core.elastic.link``), and where the ranks keep their commits."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DRIVER_VARIABLE = "HVDLITE_ELASTIC_DRIVER"
JOB_VARIABLE = "HVDLITE_ELASTIC_JOB"
RESTART_VARIABLE = "HVDLITE_ELASTIC_RESTART"
GENERATION_VARIABLE = "HVDLITE_ELASTIC_GENERATION"
SECRET_VARIABLE = "HVDLITE_ELASTIC_SECRET"

__all__ = ["DRIVER_VARIABLE", "JOB_VARIABLE", "RESTART_VARIABLE", "GENERATION_VARIABLE", "SECRET_VARIABLE",
           "signature", "base_dir", "remove_job"]


def signature(secret: str, nonce: str, message: dict[str, Any]) -> str:
    """The HMAC-SHA256 (hex) of ``message`` (without its "mac") on the connection that sent ``nonce``."""
    body = json.dumps({k: v for k, v in message.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret.encode(), f"{nonce}\n{body}".encode(), hashlib.sha256).hexdigest()


def base_dir(configured: str) -> Path:
    """The directory commits go under: the configured one, else /dev/shm if writable, else the temp dir."""
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def remove_job(configured_dir: str, job: str) -> None:
    """Delete every host's commit of elastic run ``job`` that this machine's file system holds (the driver,
    when the run ends: a host that was blacklisted has no rank left to delete its own)."""
    shutil.rmtree(base_dir(configured_dir) / f"hvdlite-elastic-{job}", ignore_errors=True)
