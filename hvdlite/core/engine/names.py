"""Generated collective names: per kind and process set, in call order, so every member makes the same."""
from __future__ import annotations

import re
import threading
import time
from typing import Optional

#: ``<kind>[.ps<id>].noname.<n>``, possibly followed by a suffix (broadcast_object's ``.size``, ``.data``).
_GENERATED = re.compile(r"^(?P<kind>.+?)(?:\.ps(?P<ps>\d+))?\.noname\.(?P<n>\d+)(?P<suffix>\..*)?$")
MOVE_WINDOW_S = 30.0  # how long after a verdict a name made before it is moved on (Names.learn): ample for a call


class Names:
    """The counters behind generated names; a fresh set per init(). After a stall verdict (or a join error),
    which every rank learns of, each rank skips past the names it failed: the ranks' next names agree again."""

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        #: (kind, set) -> ([(first, end), ...], until): per verdict, names first..end-1 move one on (learn())
        self._moves: dict[tuple[str, int], tuple[list[tuple[int, int]], float]] = {}
        self.moving = False  # whether any move is pending: the engine looks at submissions only then
        self._seen: set[tuple[str, int, object]] = set()  # (kind, set, line) of every generated name made

    def name(self, kind: str, given: Optional[str], ps_id: int = 0) -> str:
        if given is not None:
            return str(given)
        key = (kind, ps_id)
        with self._lock:
            n = self._next.get(key, 0)
            self._next[key] = n + 1
        return _name_of(kind, ps_id, n)

    def again(self, kind: str, ps_id: int, site: object) -> bool:
        """Whether a line made a generated name of ``kind`` before: a loop (ranks out of step: stalls.py ahead())."""
        seen = (kind, ps_id, site) in self._seen
        self._seen.add((kind, ps_id, site))
        return seen and site is not None

    def give_back(self, name: str, ps_id: int = 0) -> None:
        """A call refused before it submitted ``name`` (the last generated of its stream) consumes no name."""
        found = _GENERATED.match(name)
        if found is None or int(found["ps"] or 0) != ps_id:
            return
        key = (found["kind"], ps_id)
        with self._lock:
            if self._next.get(key) == int(found["n"]) + 1:
                self._next[key] = int(found["n"])

    def learn(self, failed_name: str, ps_id: int, submitted_here: bool = True) -> None:
        """A stall verdict failed ``failed_name`` on every rank: this rank's next one comes after it. Names a rank
        that never submitted it made before reading the verdict are the others' next ones: each moves one on."""
        found = _GENERATED.match(failed_name)
        if found is None or int(found["ps"] or 0) != ps_id:
            return
        key, n = (found["kind"], ps_id), int(found["n"])
        with self._lock:
            made = self._next.get(key, 0)
            if submitted_here or made <= n:
                self._next[key] = max(made, n + 1)
                return
            steps = self._moves[key][0] if key in self._moves else []
            self._moves[key] = ([*steps, (n, made)], time.monotonic() + MOVE_WINDOW_S)
            self._next[key] = made + 1
            self.moving = True

    def moved(self, name: str, ps_id: int) -> Optional[str]:
        """The name of an op submitted as ``name`` before a verdict this rank had not read (learn()); None: kept."""
        with self._lock:
            now = time.monotonic()
            for key in [key for key, (_, until) in self._moves.items() if until < now]:
                del self._moves[key]
            self.moving = bool(self._moves)
            found = _GENERATED.match(name)
            if found is None or int(found["ps"] or 0) != ps_id or (found["kind"], ps_id) not in self._moves:
                return None
            was = n = int(found["n"])
            for first, end in self._moves[(found["kind"], ps_id)][0]:  # each verdict in the order it came
                if first <= n < end:
                    n += 1
        return None if n == was else _name_of(found["kind"], ps_id, n) + (found["suffix"] or "")


def _name_of(kind: str, ps_id: int, n: int) -> str:
    return f"{kind}{f'.ps{ps_id}' if ps_id else ''}.noname.{n}"


def generated(name: str) -> tuple[str, int]:
    """A generated name's stream ("<kind>[.ps<id>]") and number, or ("", -1) for any other name (no regular
    expression: 1,000 names a round)."""
    stream, marker, number = name.rpartition(".noname.")
    if marker and stream and number.isascii() and number.isdigit():
        return stream, int(number)
    return "", -1
