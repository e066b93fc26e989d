"""Replica-divergence check: one gather of per-tensor digests, then only the first differing tensor itself."""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np

from .horovod_forms import allgather, allgather_object, grouped_allgather
from .errors import ReplicaDivergenceError
from .process_sets import ProcessSet, global_process_set

Named = list[tuple[str, np.ndarray]]  # [(name, numpy array), ...]

_FIX = ("Data-parallel replicas must stay bit-identical: broadcast the initial state from one rank "
        "(broadcast_parameters / broadcast_optimizer_state / broadcast_variables), keep buffers such as "
        "BatchNorm statistics in step (SyncBatchNorm, or broadcast them), and make random ops draw the same "
        "numbers on every rank.")


def flatten(obj: Any, leaf: Callable[[Any], Optional[np.ndarray]], prefix: str = "") -> Named:
    """(name, array) for each tensor of a nested mapping/list/tuple; ``leaf`` turns one framework tensor into a
    numpy array (None: not one; numpy arrays and numbers are tensors too). Keys and indices make the names."""
    array = leaf(obj)
    if array is None:
        array = numpy_leaf(obj)
    if array is not None:
        return [(prefix or "tensor", array)]
    out: Named = []
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            out += flatten(value, leaf, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out += flatten(value, leaf, f"{prefix}[{i}]")
    return out


def numpy_leaf(value: Any) -> Optional[np.ndarray]:
    """Numpy arrays and numbers are tensors."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return np.asarray(value)
    return None


def digest(array: np.ndarray) -> int:
    """64 bits of the array's bytes: crc32 and adler32 (both release the GIL; ~4 GB/s together)."""
    data = memoryview(np.ascontiguousarray(array)).cast("B")  # type: ignore[arg-type]
    return (zlib.crc32(data) << 32) | zlib.adler32(data)


def check_named(named: Named, process_set: ProcessSet = global_process_set) -> int:
    """Compare every rank's ``named`` tensors bit for bit; returns how many were compared. Raises
    ReplicaDivergenceError on every rank when any differs (or when the ranks hold different tensors)."""
    layout = [(name, tuple(a.shape), str(a.dtype)) for name, a in named]
    header = np.array([[len(named), zlib.crc32(repr(layout).encode())]], dtype=np.uint64)
    digests = np.fromiter((digest(a) for _, a in named), dtype=np.uint64, count=len(named))
    headers, everyone = grouped_allgather([header, digests], name="hvdlite.check_replicas.digests",
                                          process_set=process_set)
    ranks = process_set.ranks or list(range(len(headers)))
    if len({tuple(h) for h in headers.tolist()}) > 1:
        _different_layouts(layout, ranks, process_set)
    table = everyone.reshape(len(ranks), len(named))
    differing = np.flatnonzero((table != table[0]).any(axis=0)).tolist()
    if not differing:
        return len(named)
    first = differing[0]
    name, array = named[first]
    groups: dict[int, list[int]] = {}
    for rank, value in zip(ranks, table[:, first].tolist()):
        groups.setdefault(value, []).append(rank)
    common = max(groups.values(), key=lambda g: (len(g), -g[0]))
    odd = [r for r in ranks if r not in common]
    rows = allgather(np.ascontiguousarray(array).reshape(1, -1), name="hvdlite.check_replicas.tensor",
                     process_set=process_set)
    reference = rows[ranks.index(common[0])].astype(np.float64)
    worst = {r: float(np.max(np.abs(rows[ranks.index(r)].astype(np.float64) - reference), initial=0.0)) for r in odd}
    top = max(odd, key=lambda r: (worst[r] if worst[r] == worst[r] else float("inf"), -r))
    others = [named[i][0] for i in differing[1:]]
    more = (f" {len(others)} more tensor(s) differ: {', '.join(map(repr, others[:10]))}"
            f"{' ...' if len(others) > 10 else ''}." if others else "")
    raise ReplicaDivergenceError(
        f"Replicas diverge: {name!r} ({array.dtype}, shape {tuple(array.shape)}) differs on rank(s) {odd} from "
        f"rank(s) {common}; largest absolute difference {worst[top]:.6g} (rank {top}).{more} {_FIX}",
        tensor=name, ranks=tuple(odd), max_abs_diff=worst[top], tensors=tuple(named[i][0] for i in differing))


def _different_layouts(layout: list[Any], ranks: list[int], process_set: ProcessSet) -> None:
    """The ranks hold different sets of tensors: name the first difference (rare, so objects are gathered)."""
    layouts = allgather_object(layout, name="hvdlite.check_replicas.layouts", process_set=process_set)
    base = layouts[0]
    for rank, other in zip(ranks[1:], layouts[1:]):
        if other == base:
            continue
        if len(other) != len(base):
            detail = f"rank {ranks[0]} holds {len(base)} tensors, rank {rank} holds {len(other)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(base, other)) if a != b)
            detail = f"entry {i} is {base[i]} on rank {ranks[0]} and {other[i]} on rank {rank}"
        raise ReplicaDivergenceError(f"Replicas diverge: the ranks hold different tensors ({detail}). {_FIX}",
                                     tensor=base[0][0] if base else "", ranks=(rank,))
    raise ReplicaDivergenceError(f"Replicas diverge: the ranks hold different tensors. {_FIX}")


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """Check that every rank holds bit-identical copies of the numpy arrays (and numbers) in ``obj`` (nested
    mappings, lists, tuples); returns how many were compared, or raises ReplicaDivergenceError on every rank."""
    return check_named(flatten(obj, numpy_leaf), process_set)
