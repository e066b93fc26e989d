"""Tensor fusion: grouping one cycle's agreed responses into batches that share MPI calls (the same on every rank)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np

from ..reduce_ops import storage_dtype
from .requests import Kind, Request, Response

ALIGN = 64  # bytes; TensorFlow and others wrap 64-byte-aligned buffers without copying them
_ALIGN_FROM = 4096  # below this a copy by the consumer costs less than aligning


def aligned_empty(shape: tuple[Any, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on an ALIGN-byte boundary (small ones: numpy's own)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _ALIGN_FROM:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.__array_interface__["data"][0] % ALIGN
    out: np.ndarray = raw[start:start + nbytes].view(dtype).reshape(shape)
    return out


class Item:
    """One tensor of one response, as this rank takes part in it."""

    __slots__ = ("resp", "req", "index", "src", "dst", "dtype", "shape")

    def __init__(self, resp: Response, req: Optional[Request], index: int) -> None:
        self.resp = resp
        self.req = req
        self.index = index
        dtype, shape = resp.sig.tensors[index]
        self.dtype: str = dtype
        self.shape: tuple[Any, ...] = shape
        if req is not None:
            self.src: np.ndarray = req.inputs[index]
            self.dst: Any = req.outputs[index]  # an np.ndarray, or None until the executor allocates it
        else:  # a joined rank stands in: zeros for allreduce/broadcast, no rows for allgather
            gather = resp.sig.kind is Kind.ALLGATHER
            self.src = np.zeros((0,) + tuple(shape) if gather else tuple(shape), dtype=storage_dtype(dtype))
            self.dst = None if gather else aligned_empty(self.src.shape, self.src.dtype)


class Marker(NamedTuple):
    """A response with no tensors (barrier, join, process-set changes, an empty group)."""

    resp: Response
    req: Optional[Request]


def packed_below(threshold: int, chunk_bytes: int) -> int:
    """Tensors of fewer bytes than this are copied into a fusion buffer with others (larger ones are sent in place)."""
    return min(threshold, chunk_bytes) if threshold > 0 else 0


def over_cap(count: int, filled: int, nbytes: int, threshold: int) -> bool:
    """The fusion cap: whether a tensor of ``nbytes`` must start a new pack instead of joining one of ``count``
    tensors and ``filled`` bytes (a pack always takes its first tensor)."""
    return count > 0 and filled + nbytes > threshold


def batches(work: list[tuple[Response, Optional[Request]]], fusion_threshold_bytes: int) -> list[list[Any]]:
    """Group this cycle's responses: compatible tensors of fusable kinds share a batch."""
    keyed: dict[tuple[Any, ...], list[Any]] = {}
    filled: dict[tuple[Any, ...], int] = {}  # agreed bytes in each open batch of a capped kind
    order: list[list[Any]] = []
    last_key, last = None, None  # the batch of the tensor before: most follow one of the same key (no hashing)
    for resp, req in work:
        keys = resp.batch_keys
        kind = resp.sig.kind
        if not keys:
            order.append([Marker(resp, req)])
        elif fusion_threshold_bytes > 0 and kind.fusable:
            # allgather and reducescatter copy a whole batch at once: cut at the threshold by the bytes every rank
            # agrees on (the whole tensor for reducescatter, one row for allgather, whose row counts may differ)
            capped = kind is Kind.ALLGATHER or kind is Kind.REDUCESCATTER
            for index, key in enumerate(keys):
                item = Item(resp, req, index)
                batch = last if key is last_key else keyed.get(key)
                if capped:
                    nbytes = math.prod(item.shape) * storage_dtype(item.dtype).itemsize
                    if batch is not None and over_cap(len(batch), filled[key], nbytes, fusion_threshold_bytes):
                        batch = None
                if batch is None:
                    batch = keyed[key] = []
                    filled[key] = 0
                    order.append(batch)
                batch.append(item)
                last_key, last = key, batch
                if capped:
                    filled[key] += nbytes
        else:  # fusion off: a grouped op's tensors, one batch per key (a reduction's per dtype)
            groups: dict[tuple[Any, ...], list[Any]] = {}
            for index, key in enumerate(keys):
                groups.setdefault(key, []).append(Item(resp, req, index))
            order += groups.values()
    return order
