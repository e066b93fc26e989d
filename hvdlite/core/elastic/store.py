"""Node-local storage of the last committed elastic state: one file per host, replaced atomically."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, cast

from ..elastic_wire import job_dir, remove_host
from ..log import logger


class CommitStore:
    """``<dir>/hvdlite-elastic-<job>/<hostname>/commit.pkl``: the newest commit this host holds (the host name
    keeps hosts that share a file system apart, as local disks would)."""

    def __init__(self, configured_dir: str, job: str) -> None:
        self.configured_dir, self.job = configured_dir, job
        self.job_dir = job_dir(configured_dir, job)
        self.dir = self.job_dir / socket.gethostname()
        self.path = self.dir / "commit.pkl"

    def write(self, counter: int, payload: Any) -> None:
        """Write (counter, payload) so that a reader sees the old or the new commit, never a torn one."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".commit-", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as handle:
                pickle.dump({"counter": counter, "payload": payload}, handle, protocol=pickle.HIGHEST_PROTOCOL)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self) -> tuple[int, Any]:
        """(counter, payload) of the commit this host holds; (0, None) when none."""
        try:
            with open(self.path, "rb") as handle:
                data = cast(dict[Any, Any], pickle.load(handle))
            return int(data["counter"]), data["payload"]
        except FileNotFoundError:
            return 0, None
        except Exception as exc:  # noqa: BLE001 - a damaged commit counts as none; another host has one
            logger.warning("ignoring unreadable elastic commit %s: %s", self.path, exc)
            return 0, None

    def remove(self) -> None:
        """Delete this host's copy (the run finished)."""
        try:
            remove_host(self.configured_dir, self.job)
        except OSError as exc:
            logger.warning("elastic commit %s not removed: %s", self.dir, exc)
