"""Running batches of agreed responses over MPI: chunked, fused reductions, broadcasts, barriers; by kind.

Called only from the engine thread. Every MPI call here is non-blocking and polled (engine/polling.py),
so one slow collective never freezes the engine inside MPI, and the training thread keeps its core.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..reduce_ops import (Adasum, Average, ReduceOp, Sum, average_scale, bf16_to_f32, f32_to_bf16,
                          scale_inplace, scaled_copy, storage_dtype)
from . import accumulate, adasum, deterministic, polling, row_exec
from .chunks import ChunkPipeline, start_allreduce
from .fusion import Item, Marker, aligned_empty, over_cap, packable
from .mpi import MPIOps
from .requests import Kind
from .timeline import Timeline


class Executor:
    """Runs batches built by engine/fusion.py; one method per kind, chosen by an explicit table."""

    def __init__(self, mpi_ops: MPIOps, comm_of: Callable[[int], Any], size_of: Callable[[int], int],
                 fusion_threshold_bytes: int, chunk_bytes: int, timeline: Timeline,
                 members_of: Callable[[int], list[int]]) -> None:
        self.ops = mpi_ops
        self.comm_of, self.size_of, self.members_of = comm_of, size_of, members_of  # by process set id
        self.fusion_threshold_bytes = fusion_threshold_bytes
        self.chunk_bytes = chunk_bytes
        self.timeline = timeline
        self._fusion = np.empty(0, dtype=np.uint8)
        self._chunks = ChunkPipeline(self._wait)
        self.mpi_calls = 0
        self.adasum_levels = adasum.LevelComms()
        self._table: dict[Kind, Callable[[list[Any]], Iterable[tuple[Any, Any]]]] = {
            Kind.ALLREDUCE: self._allreduce, Kind.BROADCAST: self._broadcast,
            Kind.ALLGATHER: functools.partial(self._rows, row_exec.allgather),
            Kind.REDUCESCATTER: functools.partial(self._rows, row_exec.reducescatter),
            Kind.ALLTOALL: functools.partial(self._rows, row_exec.alltoall),
            Kind.BARRIER: self._barrier, Kind.JOIN: self._join,
        }

    def run(self, batch: list[Any]) -> Iterable[tuple[Any, Any]]:
        """Run one batch; returns (item, result) pairs for the engine to hand back."""
        first = batch[0]
        if isinstance(first, Marker) and first.resp.sig.kind.multi_tensor:
            return [(first, [])]  # an empty group: nothing to move, the result is an empty list
        return self._table[first.resp.sig.kind](batch)

    def _wait(self, request: Any) -> None:
        polling.wait(request)
        self.mpi_calls += 1

    # -- allreduce ------------------------------------------------------------------------------
    def _allreduce(self, items: list[Item]) -> Iterable[tuple[Item, Any]]:
        first = items[0].resp
        comm = self.comm_of(first.sig.ps_id)
        op = first.sig.op
        assert op is not None  # resolved at submit for every reduction
        pre, post = first.sig.prescale, first.sig.postscale
        if op is Adasum:
            return self._adasum(comm, items, pre, post)
        if op is Average:
            post = average_scale(post, self.size_of(first.sig.ps_id))
        if first.sig.extra is not None:  # an accumulating compression: its own Iallreduce applies the factors
            accumulating = accumulate.batch_comm(comm, self.ops, items[0].dtype, first.sig.extra, pre, post)
            if accumulating is not None:
                comm, pre, post = accumulating, 1.0, 1.0
        small: list[Item] = []
        small_bytes = 0
        threshold, chunk = self.fusion_threshold_bytes, self.chunk_bytes
        with self._chunks.batch():  # the batch's chunks travel back to back (engine/chunks.py)
            for item in items:
                nbytes = item.src.nbytes
                if nbytes == 0:
                    if item.dst is None:
                        item.dst = item.src.copy()
                    continue
                if packable(nbytes, threshold, chunk):
                    if over_cap(len(small), small_bytes, nbytes, threshold):
                        self._reduce_small(comm, small, op, pre, post)
                        small, small_bytes = [], 0
                    small.append(item)
                    small_bytes += nbytes
                else:
                    self._reduce_direct(comm, item, op, pre, post)
            if small:
                self._reduce_small(comm, small, op, pre, post)
        return zip(items, [item.dst for item in items])  # pairs made one at a time, as the engine reads them

    def _adasum(self, comm: Any, items: list[Item], pre: float, post: float) -> list[tuple[Item, Any]]:
        """Adasum of a batch (one dtype): each tensor is its own vector; half precision works in float32."""
        if len(items) > 1 and isinstance(comm, deterministic.OrderedComm):  # deterministic: cut as if unfused
            return [pair for item in items for pair in self._adasum(comm, [item], pre, post)]
        dtype = items[0].dtype
        work: type[np.floating[Any]] = np.float64 if dtype == "float64" else np.float32
        sizes = [item.src.size for item in items]
        bounds, start = [], 0
        for n in sizes:
            bounds.append((start, start + n))
            start += n
        buf = np.empty(start, dtype=work)
        for item, (lo, hi) in zip(items, bounds):
            values = bf16_to_f32(item.src.reshape(-1)) if dtype == "bfloat16" else item.src.reshape(-1)
            np.multiply(values, pre, out=buf[lo:hi], casting="unsafe")
        for item in items:
            self.timeline.begin(item.resp.name, "ADASUM_ALLREDUCE")
        adasum.reduce(comm, self.adasum_levels.levels(comm), buf, bounds, self.ops.op("float64", Sum),
                      self.ops.datatypes["float64"], self._wait)
        if post != 1.0:
            buf *= work(post)
        for item, (lo, hi) in zip(items, bounds):
            self.timeline.end(item.resp.name)
            piece = buf[lo:hi]
            out = f32_to_bf16(piece) if dtype == "bfloat16" else piece.astype(storage_dtype(dtype), copy=False)
            if item.dst is None:
                item.dst = out.reshape(item.src.shape)  # a view of this call's own buffer
            else:
                np.copyto(item.dst.reshape(-1), out)
        return [(item, item.dst) for item in items]

    def _reduce_direct(self, comm: Any, item: Item, op: ReduceOp, pre: float, post: float) -> None:
        tl = self.timeline
        self._chunks.clear((item.src, item.dst))
        if item.dst is None:
            item.dst = aligned_empty(item.src.shape, item.src.dtype)
        dst = item.dst
        out_of_place = dst is not item.src and pre == 1.0
        if dst is not item.src and not out_of_place:
            tl.begin(item.resp.name, "MEMCPY_IN")
            scaled_copy(dst, item.src, item.dtype, pre)
            tl.end(item.resp.name)
        elif dst is item.src and pre != 1.0:
            scale_inplace(dst, item.dtype, pre)
        tl.begin(item.resp.name, "MPI_ALLREDUCE")
        self._chunked_allreduce(comm, item.src.reshape(-1) if out_of_place else None, dst.reshape(-1), item.dtype,
                                op, post, functools.partial(tl.end, item.resp.name) if tl.enabled else None)

    def _chunked_allreduce(self, comm: Any, src: Optional[np.ndarray], dst: np.ndarray, dtype: str,
                           op: ReduceOp, post: float, on_done: Optional[Callable[[], None]] = None) -> None:
        """Start reducing ``dst`` (or ``src`` into it) in chunk_bytes pieces; engine/chunks.py completes them."""
        datatype = self.ops.datatype(dtype)
        mpi_op = self.ops.op(dtype, op)
        step = max(1, self.chunk_bytes // max(1, dst.itemsize))
        n = dst.shape[0]
        for start in range(0, n, step):
            piece = dst[start:start + step]
            send = self.ops.IN_PLACE if src is None else [src[start:start + step], datatype]
            # Non-blocking on every rank (a blocking and a non-blocking collective never match); polled
            # continuously while a user thread waits, with short sleeps while the training thread computes.
            request = start_allreduce(comm, self.ops.tree, send, piece, datatype, mpi_op, self._wait)
            self._chunks.post(request, piece, dtype, post, on_done if start + step >= n else None)

    def _fusion_buffer(self, nbytes: int) -> np.ndarray:
        if self._fusion.nbytes < nbytes:
            self._fusion = np.empty(max(nbytes, self.fusion_threshold_bytes), dtype=np.uint8)
        return self._fusion[:nbytes]

    def _reduce_small(self, comm: Any, items: list[Item], op: ReduceOp, pre: float, post: float) -> None:
        """Pack, reduce with as few MPI calls as the chunk size allows, unpack (a lone tensor: no packing). When no
        item has an output yet (out-of-place ops) the packed block itself becomes the outputs: views of it."""
        if len(items) == 1:
            return self._reduce_direct(comm, items[0], op, pre, post)
        tl = self.timeline
        tracing = tl.enabled
        dtype = items[0].dtype
        store = storage_dtype(dtype)
        total = sum(item.src.size for item in items)
        fresh = all([item.dst is None for item in items])  # a list: no generator call per tensor
        buf = aligned_empty((total,), store) if fresh else \
            self._fusion_buffer(total * store.itemsize).view(store)
        self._chunks.clear(item.src for item in items)
        if tracing:
            for item in items:
                tl.begin(item.resp.name, "MEMCPY_IN_FUSION_BUFFER")
        flats = [item.src if item.src.ndim == 1 else item.src.reshape(-1) for item in items]  # 1-D: no new view
        if pre == 1.0:
            np.concatenate(flats, out=buf)
        else:
            offset = 0
            for flat in flats:
                scaled_copy(buf[offset:offset + flat.size], flat, dtype, pre)
                offset += flat.size
        if tracing:
            for item in items:
                tl.end(item.resp.name)
                tl.begin(item.resp.name, "MPI_ALLREDUCE")
        self._chunked_allreduce(comm, None, buf, dtype, op, post)
        self._chunks.drain()  # the packed results are copied out (and the fusion buffer reused) next
        offset = 0
        for item, flat in zip(items, flats):
            if tracing:
                tl.end(item.resp.name)
                tl.begin(item.resp.name, "MEMCPY_OUT_FUSION_BUFFER")
            piece, offset = buf[offset:offset + flat.size], offset + flat.size
            if fresh:
                item.dst = piece.reshape(item.src.shape)
            elif item.dst is item.src:  # in place: back through the flat view of the copy in
                flat[...] = piece
            elif item.dst is None:  # an out-of-place op fused with in-place ones
                item.dst = piece.copy().reshape(item.src.shape)
            else:
                np.copyto(item.dst.reshape(-1), piece)
            if tracing:
                tl.end(item.resp.name)

    # -- broadcast ------------------------------------------------------------------------------
    def _broadcast(self, items: list[Item]) -> list[tuple[Item, Any]]:
        BYTE = self.ops.BYTE
        first = items[0].resp
        comm = self.comm_of(first.sig.ps_id)
        root = self.members_of(first.sig.ps_id).index(first.sig.root)  # the job's rank -> the set's (agreed valid)
        is_root = comm.Get_rank() == root
        packed: list[Item] = []
        for item in items:
            if item.dst is None:
                item.dst = aligned_empty(item.src.shape, item.src.dtype)
                if is_root:
                    np.copyto(item.dst, item.src)
            elif is_root and item.dst is not item.src:
                np.copyto(item.dst, item.src)
            self.timeline.begin(item.resp.name, "MPI_BCAST")
            if packable(item.dst.nbytes, self.fusion_threshold_bytes, self.chunk_bytes):
                packed.append(item)
            elif item.dst.nbytes:
                self._wait(comm.Ibcast([item.dst.reshape(-1).view(np.uint8), BYTE], root=root))
        start = 0
        while start < len(packed):  # pack up to the fusion threshold per Bcast
            group: list[Item] = []
            nbytes = 0
            while start < len(packed) and not over_cap(len(group), nbytes, packed[start].dst.nbytes,
                                                       self.fusion_threshold_bytes):
                group.append(packed[start])
                nbytes += packed[start].dst.nbytes
                start += 1
            buf = self._fusion_buffer(nbytes)
            offset = 0
            if is_root:
                for item in group:
                    buf[offset:offset + item.dst.nbytes] = item.dst.reshape(-1).view(np.uint8)
                    offset += item.dst.nbytes
            self._wait(comm.Ibcast([buf, BYTE], root=root))
            offset = 0
            if not is_root:
                for item in group:
                    item.dst.reshape(-1).view(np.uint8)[...] = buf[offset:offset + item.dst.nbytes]
                    offset += item.dst.nbytes
        for item in items:
            self.timeline.end(item.resp.name)
        return [(item, item.dst) for item in items]

    # -- allgather, reducescatter, alltoall (engine/row_exec.py) --------------------------------------
    def _rows(self, run: row_exec.RowCollective, items: list[Item]) -> list[tuple[Item, Any]]:
        return run(self.ops, self.comm_of(items[0].resp.sig.ps_id), items, self.timeline, self._wait)

    # -- the rest, one response at a time --------------------------------------------------------
    def _barrier(self, items: list[Any]) -> list[tuple[Any, Any]]:
        self._wait(self.comm_of(items[0].resp.sig.ps_id).Ibarrier())
        return [(items[0], None)]

    def _join(self, items: list[Any]) -> list[tuple[Any, Any]]:
        return [(items[0], items[0].resp.last_joined)]


__all__ = ["Executor"]
