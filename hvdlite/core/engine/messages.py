"""The full round's message: one rank's pending requests (names, signatures, ages, call sites) and round fields."""
from __future__ import annotations

from typing import Any, Collection, Iterable, Optional, Sequence

from . import callsite
from .requests import Signature, shared


class RankMessage:
    """One rank's pending requests as parallel lists (names, signature and call-site indices into distinct ones,
    ages), then the round's fields: 1,000 names pickle as 1,000 strings."""

    WIRE = ("names", "sig_index", "sigs", "ages", "site_index", "site_texts", "shutdown", "join_cycle", "tune",
            "elsewhere", "again")
    __slots__ = (*WIRE, "_by_key")  # WIRE: what crosses the wire, in order (``_by_key``: made where it is read)

    def __init__(self, pending: Collection[Any] = (), now: float = 0.0, shutdown: bool = False,
                 join_cycle: int = -1, tune: Optional[dict[Any, Any]] = None,
                 elsewhere: Sequence[tuple[int, str]] = ()) -> None:
        self.names, self.sig_index, self.sigs = name_table((req.name, req.sig) for req in pending)
        self.ages = [now - req.submitted for req in pending]
        self.site_index, self.site_texts = callsite.site_table(pending)
        self.shutdown = shutdown
        self.join_cycle = join_cycle  # cycle at which this rank joined, -1 if it has not
        self.tune = tune  # rank 0 only: autotune settings every rank adopts after this round
        self.elsewhere = list(elsewhere)  # (set, name) pending in this rank's other engines (a stall's note)
        # the requests (indices) whose generated name comes from a line used before (a loop)
        self.again = [i for i, req in enumerate(pending) if getattr(req, "again", False)]
        self._by_key: Optional[dict[tuple[int, str], int]] = None  # made on the receiving side when an error reads it

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, field) for field in self.WIRE)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for field, value in zip(self.WIRE, state):
            setattr(self, field, value)
        self.sigs = [shared(sig) for sig in self.sigs]  # equal signatures of every rank are one object: ``is`` agrees
        self._by_key = None

    def signatures(self) -> list[Signature]:
        sigs = self.sigs
        return [sigs[i] for i in self.sig_index]

    def site(self, key: tuple[int, str]) -> Optional[str]:
        """The "file:line" where this rank submitted ``key`` (process set, name), if known (error text)."""
        if self._by_key is None:
            self._by_key = {(sig.ps_id, name): i for i, (name, sig) in enumerate(zip(self.names, self.signatures()))}
        index = self._by_key.get(key, -1)
        text_index = self.site_index[index] if index >= 0 else -1
        return self.site_texts[text_index] if text_index >= 0 else None


def name_table(pairs: Iterable[tuple[str, Signature]]) -> tuple[list[str], list[int], list[Signature]]:
    """The names, each one's index into the distinct signatures, and those (by identity: equal ones are shared)."""
    names: list[str] = []
    index: list[int] = []
    sigs: list[Signature] = []
    index_of: dict[int, int] = {}
    for name, sig in pairs:
        i = index_of.get(id(sig))
        if i is None:
            i = index_of[id(sig)] = len(sigs)
            sigs.append(sig)
        names.append(name)
        index.append(i)
    return names, index, sigs
