"""Generated collective names: per kind and process set, in call order, so every member makes the same."""
from __future__ import annotations

import re
import threading
from typing import Optional

#: ``<kind>[.ps<id>].noname.<n>``, possibly followed by a suffix (broadcast_object's ``.size``, ``.data``).
_GENERATED = re.compile(r"^(?P<kind>.+?)(?:\.ps(?P<ps>\d+))?\.noname\.(?P<n>\d+)(?:\..*)?$")


class Names:
    """The counters behind generated names; a fresh set per init() (State owns one).

    A stall verdict (or an op refused because ranks have joined) is a job-wide event every rank learns of
    (``learn()``, from the engine thread): a rank that raised before it generated a name the others
    submitted, or generated one the others never did, or had joined, skips past every name the verdict
    failed, so the ranks' next generated names agree again.
    """

    def __init__(self) -> None:
        self._next: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def name(self, kind: str, given: Optional[str], ps_id: int = 0) -> str:
        """The caller's name, or ``<kind>[.ps<id>].noname.<n>`` numbered per kind and process set."""
        if given is not None:
            return str(given)
        key = (kind, ps_id)
        with self._lock:
            n = self._next.get(key, 0)
            self._next[key] = n + 1
        scope = f".ps{ps_id}" if ps_id else ""
        return f"{kind}{scope}.noname.{n}"

    def give_back(self, name: str, ps_id: int = 0) -> None:
        """A call refused on this rank before it submitted ``name`` (a wrong argument, a bad root) did not use
        it: if it is the last generated name of its kind and set, the next call gets it again. So a refused
        call consumes no name, whether it comes before or after a stall verdict that named the op it stood
        for (the verdict alone moves this rank past that name)."""
        found = _GENERATED.match(name)
        if found is None or int(found["ps"] or 0) != ps_id:
            return
        key = (found["kind"], ps_id)
        with self._lock:
            if self._next.get(key) == int(found["n"]) + 1:
                self._next[key] = int(found["n"])

    def learn(self, failed_name: str, ps_id: int) -> None:
        """A stall verdict failed ``failed_name`` in process set ``ps_id`` on every rank: if it is a generated
        name, this rank's next name of that kind and set comes after it."""
        found = _GENERATED.match(failed_name)
        if found is None or int(found["ps"] or 0) != ps_id:
            return
        key = (found["kind"], ps_id)
        with self._lock:
            self._next[key] = max(self._next.get(key, 0), int(found["n"]) + 1)
