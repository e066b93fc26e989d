"""The full round's message: one rank's pending requests (names, signatures, ages, call sites) and round fields.

Its own module so that negotiation.py (which sends and decides from it) and mismatch.py (which explains from it)
both import it without importing each other."""
from __future__ import annotations

from typing import Any, Collection, Optional, Sequence

from . import callsite
from .requests import Signature, shared

__all__ = ["RankMessage", "pending_message"]


class RankMessage:
    """What one rank sends on the full path: its pending requests as parallel lists (names; for each an index
    into the message's distinct signatures, its age in seconds, an index into its distinct call-site texts or
    -1), then the round's own fields. A round of 1,000 new names from one line with one signature thus pickles
    1,000 strings, a few numbers each and one signature, not 1,000 tuples and signatures (see ``decide``)."""

    __slots__ = ("names", "sig_index", "sigs", "ages", "site_index", "site_texts", "shutdown", "join_cycle", "tune",
                 "elsewhere", "_by_key")

    def __init__(self, reqs: Sequence[tuple[str, Signature, float]] = (), shutdown: bool = False,
                 join_cycle: int = -1, tune: Optional[dict[Any, Any]] = None,
                 sites: Optional[dict[tuple[int, str], str]] = None,
                 elsewhere: Sequence[tuple[int, str]] = ()) -> None:
        """From (name, signature, age) triples and a (process set, name) -> "file:line" table (tests, tools);
        the engine builds its messages with ``pending_message``."""
        sigs: list[Signature] = []
        index_of: dict[int, int] = {}
        self.names = [name for name, _, _ in reqs]
        self.sig_index = [_index(index_of, sigs, sig) for _, sig, _ in reqs]
        self.sigs = sigs
        self.ages = [age for _, _, age in reqs]
        texts = list(dict.fromkeys((sites or {}).values()))
        text_index = {text: i for i, text in enumerate(texts)}
        self.site_index = [text_index.get((sites or {}).get((sig.ps_id, name), ""), -1) for name, sig, _ in reqs]
        self.site_texts = texts
        self.shutdown = shutdown
        self.join_cycle = join_cycle  # cycle at which this rank joined, -1 if it has not
        self.tune = tune  # rank 0 only: autotune settings every rank adopts after this round
        self.elsewhere = list(elsewhere)  # (set, name) pending in this rank's other engines (a stall's note)
        self._by_key: Optional[dict[tuple[int, str], int]] = None  # made on the receiving side when an error reads it

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.names, self.sig_index, self.sigs, self.ages, self.site_index, self.site_texts, self.shutdown,
                self.join_cycle, self.tune, self.elsewhere)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self.names, self.sig_index, sigs, self.ages, self.site_index, self.site_texts, self.shutdown,
         self.join_cycle, self.tune, self.elsewhere) = state
        self.sigs = [shared(sig) for sig in sigs]  # equal signatures of every rank are one object: ``is`` agrees
        self._by_key = None

    def signatures(self) -> list[Signature]:
        """Each request's signature, in order."""
        sigs = self.sigs
        return [sigs[i] for i in self.sig_index]

    @property
    def reqs(self) -> list[tuple[str, Signature, float]]:
        """(name, signature, age) of each request, in order (error text)."""
        return list(zip(self.names, self.signatures(), self.ages))

    def site(self, key: tuple[int, str]) -> Optional[str]:
        """The "file:line" where this rank submitted ``key`` (process set, name), if known (error text)."""
        if self._by_key is None:
            self._by_key = {(sig.ps_id, name): i for i, (name, sig) in enumerate(zip(self.names, self.signatures()))}
        index = self._by_key.get(key, -1)
        text_index = self.site_index[index] if index >= 0 else -1
        return self.site_texts[text_index] if text_index >= 0 else None


def _index(index_of: dict[int, int], sigs: list[Signature], sig: Signature) -> int:
    """``sig``'s position in ``sigs``, appended when new (by identity: equal local signatures are mostly shared)."""
    index = index_of.get(id(sig))
    if index is None:
        index = index_of[id(sig)] = len(sigs)
        sigs.append(sig)
    return index


def pending_message(pending: Collection[Any], now: float, **fields: Any) -> RankMessage:
    """This rank's message of a full round: its pending requests (names, signatures, ages, call sites), ``fields``."""
    msg = RankMessage(**fields)
    sigs: list[Signature] = []
    index_of: dict[int, int] = {}  # id(signature) -> its index (one loop, no call per request: 1,000 per round)
    sig_index = []
    for req in pending:
        index = index_of.get(id(req.sig))
        if index is None:
            index = index_of[id(req.sig)] = len(sigs)
            sigs.append(req.sig)
        sig_index.append(index)
    msg.names = [req.name for req in pending]
    msg.sig_index = sig_index
    msg.sigs = sigs
    msg.ages = [now - req.submitted for req in pending]
    msg.site_index, msg.site_texts = callsite.site_table(pending)
    return msg
