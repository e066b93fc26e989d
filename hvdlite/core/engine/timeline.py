"""The timeline: a Chrome-trace JSON of every tensor's phases, loadable in Perfetto or chrome://tracing."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any, Optional

FLUSH_S = 0.05  # events reach the file within this long (a job that hangs or is killed leaves them behind)


def negotiate_activity(kind: Any, op: Any = None) -> str:
    """Horovod's name of the negotiation phase (``NEGOTIATE_ALLREDUCE``...; Adasum's: ``NEGOTIATE_ADASUM``)."""
    if op is not None and getattr(op, "value", None) == "Adasum":
        return "NEGOTIATE_ADASUM"
    return "NEGOTIATE_" + str(kind).upper()


class Timeline:
    """Writes trace events, one row ("process") per tensor name (no-ops while disabled); a thread flushes them."""

    def __init__(self) -> None:
        self._file: Optional[IO[str]] = None
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._open: dict[str, str] = {}
        self._t0 = time.perf_counter()
        self.mark_cycles = False
        self.enabled = False
        self._dirty = False
        self._flusher: Optional[threading.Thread] = None
        self._stop_flushing = threading.Event()

    def start(self, path: str, mark_cycles: bool = False) -> None:
        with self._lock:
            if self._file is not None:
                self._close_locked()
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[\n")
            self._rows.clear()
            self._open.clear()
            self.mark_cycles = mark_cycles
            self.enabled = True
            self._stop_flushing = threading.Event()
            self._flusher = threading.Thread(target=self._flush_loop, args=(self._stop_flushing,),
                                             name="hvdlite-timeline", daemon=True)
            self._flusher.start()

    def _flush_loop(self, stop: threading.Event) -> None:
        while not stop.wait(FLUSH_S):
            with self._lock:
                if self._file is not None and self._dirty:
                    self._file.flush()
                    self._dirty = False

    def stop(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self._stop_flushing.set()
        if self._file is None:
            return
        now = self.now()
        for name in list(self._open):  # close phases left open so the trace stays well formed
            self._write({"ph": "E", "ts": now, "pid": self._rows[name], "tid": 0})
        self._file.write(json.dumps({"name": "timeline_end", "ph": "i", "ts": now, "pid": 0, "tid": 0,
                                     "s": "g"}) + "\n]\n")
        self._file.close()
        self._file = None
        self.enabled = False
        self._open.clear()

    def counter(self, name: str, ts: float, values: dict[str, Any]) -> None:
        """A counter event (one line per key in the trace viewer) at time ``ts`` (from ``now()``)."""
        if self.enabled:
            self._emit({"name": name, "ph": "C", "ts": ts, "pid": 0, "tid": 0, "args": values})

    def now(self) -> float:
        """Microseconds since the timeline's origin, as its events are stamped."""
        return round((time.perf_counter() - self._t0) * 1e6, 3)

    def _emit(self, event: dict[Any, Any]) -> None:
        with self._lock:
            if self._file is not None:
                self._write(event)

    def _write(self, event: dict[Any, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
        self._dirty = True

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._write({"name": "process_name", "ph": "M", "pid": row, "tid": 0, "args": {"name": name}})
            self._write({"name": "process_sort_index", "ph": "M", "pid": row, "tid": 0,
                         "args": {"sort_index": row}})
        return row

    def begin(self, name: str, phase: str, **args: object) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._file is None:
                return
            row = self._row(name)
            if name in self._open:
                self._write({"ph": "E", "ts": self.now(), "pid": row, "tid": 0})
            event = {"name": phase, "ph": "B", "ts": self.now(), "pid": row, "tid": 0}
            if args:
                event["args"] = args
            self._write(event)
            self._open[name] = phase

    def end(self, name: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._file is None or self._open.pop(name, None) is None:
                return
            self._write({"ph": "E", "ts": self.now(), "pid": self._rows[name], "tid": 0})

    def cycle(self, number: int) -> None:
        if self.enabled and self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "ts": self.now(), "pid": 0, "tid": 0, "s": "g",
                        "args": {"cycle": number}})
