"""Elastic training state: commit() keeps it in this host's CommitStore, sync() agrees on the newest commit."""
from __future__ import annotations

import copy
import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, cast

from .. import runtime
from ..config import getenv
from ..elastic_wire import JOB_VARIABLE, job_dir, remove_host
from ..log import logger
from ..horovod_forms import allgather_object, broadcast_object
from . import link as driver


class CommitStore:
    """``<dir>/hvdlite-elastic-<job>/<hostname>/commit.pkl``: this host's newest commit (apart on a shared disk)."""

    def __init__(self, configured_dir: str, job: str) -> None:
        self.configured_dir, self.job = configured_dir, job
        self.dir = job_dir(configured_dir, job) / socket.gethostname()
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


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank at the same commit on a host change (Horovod's ``skip_sync``: hvdlite always syncs)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of this elastic job changed: the state is committed and the job "
                         "restarts at its new size")
        self.skip_sync = skip_sync


class State:
    """Base class of the elastic states: subclasses say what a snapshot is (``_snapshot``/``_apply``)."""

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._get_rank = get_rank or runtime.rank
        self._reset_callbacks: list[Callable[[], None]] = []
        self._saved: Any = None
        self.commit_counter = 0

    def _snapshot(self) -> Any:
        raise NotImplementedError

    def _apply(self, snapshot: Any) -> None:
        raise NotImplementedError

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions run (in order) after every restart of the job, once the state is synced."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Hook for subclasses: adapt to a new world size (called before the reset callbacks)."""

    def save(self) -> None:
        """Keep a copy of the current state in memory (restore() returns to it)."""
        self._saved = copy.deepcopy(self._snapshot())

    def restore(self) -> None:
        """Return to the last save()/commit()."""
        if self._saved is not None:
            self._apply(copy.deepcopy(self._saved))

    def commit(self) -> None:
        """Save the state, keep it on this host, then check for host changes (every rank, at the same step)."""
        self.save()
        self.commit_counter += 1
        self.keep()
        self.check_host_updates()

    def keep(self, if_newer: bool = False) -> None:
        """Write the last commit to this host's store (local rank 0); ``if_newer``: only over an older one."""
        store = self._store()
        if store is not None and runtime.local_rank() == 0 and (not if_newer or store.read()[0] < self.commit_counter):
            store.write(self.commit_counter, self._saved)

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank, at this call, if the driver's hosts changed (rank 0 asks)."""
        lk = driver.link()
        if not lk.enabled:
            return
        generation = lk.current_generation() if self._get_rank() == 0 else 0
        generation = self._bcast_object(generation, 0, name="hvdlite.elastic.generation")
        if generation != lk.generation:
            logger.info("hosts changed (driver generation %d -> %d) at commit %d", lk.generation, generation,
                        self.commit_counter)
            raise HostsUpdatedInterrupt(skip_sync=False)

    def sync(self, in_memory: bool = False) -> None:
        """Agree on the newest commit any rank holds, from the lowest rank that holds it: at a start its host's (none
        anywhere: rank 0's current state); ``in_memory`` after an in-process recovery, the one in memory (a rank lost
        mid-commit may have left some a commit ahead; equal counters: every survivor restored it already)."""
        rank = self._get_rank()
        if in_memory:  # (the root sends its state as the reset callbacks left it: the same on every survivor)
            mine, payload = (self.commit_counter if self._saved is not None else 0), None
        else:
            mine, payload = store.read() if (store := self._store()) is not None else (0, None)
        counters = allgather_object(mine, name="hvdlite.elastic.counters")
        newest = max(counters)
        root = counters.index(newest)  # rank 0 when no host holds a commit: then its current state goes out
        if not in_memory or min(counters) != newest:
            held = (self._snapshot() if payload is None else payload) if rank == root else None
            snapshot = self._bcast_object(held, root, name="hvdlite.elastic.sync")
            if rank != root or (newest > 0 and not in_memory):
                self._apply(copy.deepcopy(snapshot))
        self.commit_counter = newest
        message = (f"resumed {'in memory ' if in_memory else ''}from commit {newest}, held by rank {root}; "
                   f"{len(counters)} ranks now" if newest > 0 or in_memory
                   else f"no commit to resume from: started from rank 0's state; {len(counters)} ranks")
        self.save()
        logger.info(message)
        if rank == 0 and not in_memory:
            driver.link().send(op="log", text=message, commit=self.commit_counter)

    def _store(self) -> Optional[CommitStore]:
        job = getenv(JOB_VARIABLE)
        return CommitStore(runtime.state().config.elastic_commit_dir, job) if job else None

    def finish(self) -> None:  # the run is over: drop this host's commit
        store = self._store()
        if store is not None and runtime.local_rank() == 0:
            try:
                remove_host(store.configured_dir, store.job)
            except OSError as exc:
                logger.warning("elastic commit %s not removed: %s", store.dir, exc)


class ObjectState(State):
    """State made of named Python values, reachable as attributes (``state.epoch``): a value with
    ``state_dict()``/``load_state_dict()`` is snapshotted through them and restored in place, any other copied."""

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank)
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def _snapshot(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self._names}
        return {name: ("stateful", v.state_dict()) if _stateful(v) else ("value", v) for name, v in values.items()}

    def _apply(self, snapshot: dict[str, Any]) -> None:
        for name, (kind, value) in snapshot.items():
            current: Any = getattr(self, name, None)
            if kind == "stateful" and _stateful(current):
                current.load_state_dict(value)
            else:
                setattr(self, name, value)

    def reset(self) -> None:
        for name in self._names:
            value = getattr(self, name)
            if getattr(value, "elastic_resettable", False):
                value.reset()


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
