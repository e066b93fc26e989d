"""The collectives whose rows differ per rank (allgather, reducescatter, alltoall): counts first, then bytes."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ..reduce_ops import scale_inplace, scaled_copy, storage_dtype
from . import deterministic
from .fusion import Item, aligned_empty
from .mpi import counts_displacements

if TYPE_CHECKING:
    from .execution import Executor

Wait = Callable[[Any], None]  # completes one MPI request


def row_counts(comm: Any, items: list[Item], wait: Wait) -> np.ndarray:
    """Every rank's rows of each tensor of an allgather batch: ``[rank, tensor]`` (also a data plane's)."""
    rows = np.array([item.src.shape[0] for item in items], dtype=np.int64)
    all_rows = np.empty((comm.Get_size(), len(items)), dtype=np.int64)
    wait(comm.Iallgather(rows, all_rows))
    return all_rows


def splits_of(comm: Any, item: Item, wait: Wait) -> tuple[np.ndarray, np.ndarray]:
    """An alltoall's rows sent to each rank (its splits, even by default) and received from each."""
    nranks = comm.Get_size()
    assert item.req is not None
    splits = item.req.splits
    if splits is None:
        splits = np.full(nranks, item.src.shape[0] // nranks, dtype=np.int64)
    splits = np.ascontiguousarray(splits, dtype=np.int64)
    recv_splits = np.empty(nranks, dtype=np.int64)
    wait(comm.Ialltoall(splits, recv_splits))
    return splits, recv_splits


def allgather(ex: Executor, items: list[Item]) -> list[tuple[Item, Any]]:
    """Every rank's rows of each tensor, in rank order: the row counts travel first, then one Iallgatherv."""
    ops, comm, timeline, wait = ex.ops, ex.comm_of(items[0].resp.sig.ps_id), ex.timeline, ex.wait
    BYTE = ops.BYTE
    nranks = comm.Get_size()
    for item in items:
        timeline.begin(item.resp.name, "MPI_ALLGATHER")
    all_rows = row_counts(comm, items, wait)
    row_bytes = np.array([math.prod(item.shape) * storage_dtype(item.dtype).itemsize
                          for item in items], dtype=np.int64)
    per_rank, displs = counts_displacements((all_rows * row_bytes).sum(axis=1))
    whole = [(int(all_rows[:, i].sum()),) + tuple(item.shape) for i, item in enumerate(items)]
    flats = [item.src.reshape(-1).view(np.uint8) for item in items]
    send = flats[0] if len(items) == 1 else np.concatenate(flats)
    item = items[0]
    into = len(items) == 1 and _fits(item.dst, whole[0], item.dtype)
    recv = item.dst.reshape(-1).view(np.uint8) if into else aligned_empty((int(per_rank.sum()),), np.uint8)
    me = comm.Get_rank()
    if into and send.__array_interface__["data"][0] == recv.__array_interface__["data"][0] + int(displs[me]):
        send = ops.IN_PLACE  # the caller's rows already sit where they go in its output
    elif into and np.shares_memory(send, recv):
        send = send.copy()
    wait(comm.Iallgatherv(send if send is ops.IN_PLACE else [send, BYTE], [recv, (per_rank, displs), BYTE]))
    if len(items) == 1:  # the received bytes are already the output, in rank order
        timeline.end(item.resp.name)
        return [(item, item.dst if into else recv.view(storage_dtype(item.dtype)).reshape(whole[0]))]
    results = []
    for i, item in enumerate(items):
        pieces = []
        for r in range(nranks):
            start = int(displs[r] + (all_rows[r, :i] * row_bytes[:i]).sum())
            pieces.append(recv[start:start + int(all_rows[r, i] * row_bytes[i])])
        out = item.dst if _fits(item.dst, whole[i], item.dtype) else aligned_empty(whole[i], storage_dtype(item.dtype))
        np.concatenate(pieces, out=out.reshape(-1).view(np.uint8))
        timeline.end(item.resp.name)
        results.append((item, out))
    return results


def reducescatter(ex: Executor, items: list[Item]) -> list[tuple[Item, Any]]:
    """This rank's rows (``deterministic.slices``) of each tensor's reduction, in one Ireduce_scatter."""
    sig = items[0].resp.sig
    ops, comm, timeline = ex.ops, ex.comm_of(sig.ps_id), ex.timeline
    nranks, me = comm.Get_size(), comm.Get_rank()
    op, pre, post = ex.reduction(sig)
    dtype = items[0].dtype
    store = storage_dtype(dtype)
    splits = [deterministic.slices(item.src.shape[0], nranks) for item in items]
    row_elems = [math.prod(item.src.shape[1:]) for item in items]
    counts = [sum(s[r] * e for s, e in zip(splits, row_elems)) for r in range(nranks)]
    if len(items) == 1 and pre == 1:  # already in rank order: reduce straight from the input
        send = items[0].src.reshape(-1)
    else:
        send = np.empty(sum(counts), dtype=store)
        offset = 0
        for r in range(nranks):
            for item, s, e in zip(items, splits, row_elems):
                lo = sum(s[:r]) * e
                n = s[r] * e
                scaled_copy(send[offset:offset + n], item.src.reshape(-1)[lo:lo + n], dtype, pre)
                offset += n
    dst = items[0].dst
    into = len(items) == 1 and _fits(dst, (splits[0][me],) + tuple(items[0].src.shape[1:]), dtype) \
        and not np.shares_memory(dst, send)
    recv = dst.reshape(-1) if into else np.empty(counts[me], dtype=store)
    for item in items:
        timeline.begin(item.resp.name, "MPI_REDUCESCATTER")
    datatype = ops.datatypes[dtype]
    ex.wait(comm.Ireduce_scatter([send, datatype], [recv, datatype], counts, ops.op(dtype, op)))
    scale_inplace(recv, dtype, post)
    if into:
        timeline.end(items[0].resp.name)
        return [(items[0], dst)]
    results, offset = [], 0
    for item, s, e in zip(items, splits, row_elems):
        n = s[me] * e
        shape = (s[me],) + tuple(item.src.shape[1:])
        out = item.dst if _fits(item.dst, shape, dtype) else aligned_empty(shape, store)
        out.reshape(-1)[...] = recv[offset:offset + n]
        results.append((item, out))
        offset += n
        timeline.end(item.resp.name)
    return results


def alltoall(ex: Executor, items: list[Item]) -> list[tuple[Item, Any]]:
    """One tensor's rows sent by its splits (even by default): the splits travel first, then one Ialltoallv."""
    BYTE, comm, timeline, wait = ex.ops.BYTE, ex.comm_of(items[0].resp.sig.ps_id), ex.timeline, ex.wait
    item = items[0]
    src = item.src
    timeline.begin(item.resp.name, "MPI_ALLTOALL")
    splits, recv_splits = splits_of(comm, item, wait)
    row_bytes = math.prod(src.shape[1:]) * src.itemsize
    scounts, sdispls = counts_displacements(splits * row_bytes)
    rcounts, rdispls = counts_displacements(recv_splits * row_bytes)
    out = aligned_empty((int(recv_splits.sum()),) + tuple(src.shape[1:]), src.dtype)
    wait(comm.Ialltoallv([src.reshape(-1).view(np.uint8), (scounts, sdispls), BYTE],
                         [out.reshape(-1).view(np.uint8), (rcounts, rdispls), BYTE]))
    timeline.end(item.resp.name)
    return [(item, (out, recv_splits))]


def _fits(dst: Optional[np.ndarray], shape: tuple[Any, ...], dtype: str) -> bool:
    """Whether a caller-given output (allgather/reducescatter ``outputs``) can take the result directly."""
    return dst is not None and dst.shape == shape and dst.dtype == storage_dtype(dtype) and dst.flags.c_contiguous
