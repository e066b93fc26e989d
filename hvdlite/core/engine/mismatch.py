"""Mismatch and stall text: what differs between the ranks' arguments for one name, arguments no member can use,
and where a stalled name's ranks were instead."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from . import callsite
from .messages import RankMessage
from .requests import FIELD_LABELS, Kind, Signature

__all__ = ["describe_mismatch", "invalid_argument", "submitted_at", "used_elsewhere", "waiting_instead"]


def invalid_argument(name: str, sigs: dict[int, Signature], members: list[int]) -> Optional[str]:
    """An argument some member passed that cannot work, checked here where every member sees every member's
    arguments: each member fails the op with the same ValueError (none raises alone, none stalls)."""
    first = sigs[min(sigs)]
    if first.kind is Kind.BROADCAST:
        bad = {rank: sig.root for rank, sig in sigs.items() if sig.root not in members}
        if bad:
            detail = "; ".join(f"{_ranks(ranks)}: {root}" for root, ranks in _group(bad).items())
            return (f"broadcast of {name!r}: root_rank is not a member of the process set ({detail}); the set's "
                    f"ranks are {members}. root_rank is a rank of the whole job (as in Horovod), also with "
                    f"process_set=; pass one of the set's ranks")
    return None


def _group(values: dict[int, Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    return groups


def describe_mismatch(name: str, sigs: dict[int, Signature]) -> Optional[str]:
    """None if all ranks agree, else a message naming what differs and on which ranks."""
    distinct = set(sigs.values())
    if len(distinct) == 1:
        return None
    kind = sigs[min(sigs)].kind
    for field, label in FIELD_LABELS.items():
        values = {rank: getattr(sig, field) for rank, sig in sigs.items()}
        if len(set(values.values())) == 1:
            continue
        if field == "tensors":
            label, values = _tensor_difference(kind, values)
        groups: dict[str, list[int]] = {}
        for rank, value in sorted(values.items()):
            groups.setdefault(_show(value), []).append(rank)
        detail = "; ".join(f"{_ranks(ranks)}: {value}" for value, ranks in groups.items())
        return (f"Mismatched {kind} for tensor {name!r}: the {label} differs across ranks ({detail}). "
                f"Every rank must submit a name with the same {label}; give different tensors "
                f"different names.")
    return f"Mismatched {kind} for tensor {name!r}: ranks submitted different arguments"


def _tensor_difference(kind: Kind, values: dict[int, tuple[Any, ...]]) -> tuple[str, dict[int, object]]:
    if len({len(v) for v in values.values()}) > 1:
        return "number of tensors", {r: len(v) for r, v in values.items()}
    if len({tuple(t[0] for t in v) for v in values.values()}) > 1:
        return "dtype", {r: _one(tuple(t[0] for t in v)) for r, v in values.items()}
    label = "shape beyond the first dimension" if kind in (Kind.ALLGATHER, Kind.ALLTOALL) else "shape"
    return label, {r: _one(tuple(t[1] for t in v)) for r, v in values.items()}


def _one(values: tuple[Any, ...]) -> object:
    return values[0] if len(values) == 1 else list(values)


def _show(value: object) -> str:
    return str(tuple(value)) if isinstance(value, tuple) and all(isinstance(x, int) for x in value) \
        else str(value)


def _ranks(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# -- stall text (engine/negotiation.py's Stalled reads it only when a warning or verdict needs it) --------------
def submitted_at(messages: Sequence[RankMessage], key: tuple[int, str], ranks: Iterable[int]) -> str:
    """Where each of ``ranks`` submitted ``key`` in the user's code (from their messages)."""
    return callsite.describe({r: messages[r].site(key) for r in ranks})


def waiting_instead(messages: Sequence[RankMessage], missing: list[int], most: int = 3) -> str:
    """What each missing rank had pending instead of a stalled name, with its lines."""
    parts = []
    for rank in missing:
        msg = messages[rank]
        pending = [f"{name!r} at {msg.site((sig.ps_id, name)) or 'an unknown line'}"
                   for name, sig in list(zip(msg.names, msg.signatures()))[:most]]
        more = len(msg.names) - most
        listed = ", ".join(pending) + (f" and {more} more" if more > 0 else "")
        parts.append(f" Rank {rank} was waiting on {listed} instead." if pending
                     else f" Rank {rank} had submitted nothing.")
    return "".join(parts)


def used_elsewhere(table: dict[tuple[int, str], dict[int, int]], messages: Sequence[RankMessage], ps_id: int,
                   name: str, missing: list[int]) -> str:
    """For a stalled name: which missing ranks have it pending under another process set (legal order, so shown,
    not refused), in this round's table or in their other engines (``RankMessage.elsewhere``)."""
    used: dict[int, set[int]] = {}
    pairs = [(key, r) for key, entries in table.items() for r in entries if r in missing]
    for (other_ps, other_name), rank in pairs + [(key, r) for r in missing for key in messages[r].elsewhere]:
        if other_name == name and other_ps != ps_id:
            used.setdefault(other_ps, set()).add(rank)
    return "; ".join(f"rank(s) {sorted(ranks)} submitted it for process set {other_ps} instead"
                     for other_ps, ranks in sorted(used.items()) if ranks)
