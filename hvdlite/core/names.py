"""Generated collective names: per kind and process set, in call order, so every member makes the same."""
from __future__ import annotations

import itertools
from typing import Any, Optional


class Names:
    """The counters behind generated names; a fresh set per init() (State owns one)."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, int], Any] = {}

    def name(self, kind: str, given: Optional[str], ps_id: int = 0) -> str:
        """The caller's name, or ``<kind>[.ps<id>].noname.<n>`` numbered per kind and process set."""
        if given is not None:
            return str(given)
        counter = self._counters.setdefault((kind, ps_id), itertools.count())
        scope = f".ps{ps_id}" if ps_id else ""
        return f"{kind}{scope}.noname.{next(counter)}"
