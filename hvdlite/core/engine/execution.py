"""Running batches of agreed responses, by kind: chunked, fused reductions, broadcasts, barriers over MPI, or on a
data plane when their requests name one (the agreed row counts and splits over MPI, the bytes over the plane).

Every MPI call here is non-blocking and polled (engine/polling.py): a slow collective never freezes the engine
inside MPI, and the training thread keeps its core.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..config import Config
from ..errors import HvdliteError
from ..reduce_ops import (Adasum, Average, ReduceOp, Scale, Sum, bf16_to_f32, f32_to_bf16, scale_inplace,
                          scaled_copy, storage_dtype)
from . import adasum, deterministic, mpi, polling, row_exec
from .chunks import ChunkPipeline, halves, start_allreduce
from .fusion import Item, Marker, aligned_empty, over_cap, packed_below
from .planes import DataPlane, PlaneTable
from .psets import Registry
from .requests import Kind, Signature
from .stalls import Stop
from .timeline import Timeline


class Executor:
    """Runs batches built by engine/fusion.py: one method per kind (and per data plane's kind), by a table."""

    def __init__(self, mpi_ops: mpi.MPIOps, psets: Registry, config: Config, timeline: Timeline,
                 planes: Optional[PlaneTable]) -> None:
        self.ops = mpi_ops
        self.psets = psets
        self.comm_of = deterministic.comms(psets.comm, mpi_ops, config.deterministic)  # by process set id
        self.config = config  # its fusion_threshold_bytes and allreduce_chunk_bytes change with autotune
        self.timeline = timeline
        self.planes = planes  # this job's data planes (None: MPI only)
        self._fusion = np.empty(0, dtype=np.uint8)
        self._chunks = ChunkPipeline(self.wait)
        self.mpi_calls = 0
        self.adasum_levels = adasum.LevelComms()
        self._table: dict[Kind, Callable[[list[Any]], Iterable[tuple[Any, Any]]]] = {
            Kind.ALLREDUCE: self._allreduce, Kind.BROADCAST: self._broadcast,
            Kind.ALLGATHER: functools.partial(row_exec.allgather, self),
            Kind.REDUCESCATTER: functools.partial(row_exec.reducescatter, self),
            Kind.ALLTOALL: functools.partial(row_exec.alltoall, self),
            Kind.BARRIER: self._barrier, Kind.JOIN: self._join,
        }
        self._plane_table: dict[Kind, Callable[[DataPlane, list[Item]], list[Any]]] = {
            Kind.ALLREDUCE: self._plane_allreduce, Kind.ALLGATHER: self._plane_allgather,
            Kind.BROADCAST: self._plane_broadcast, Kind.REDUCESCATTER: self._plane_reducescatter,
            Kind.ALLTOALL: self._plane_alltoall}

    def run(self, batch: list[Any]) -> Iterable[tuple[Any, Any]]:
        """Run one batch; returns (item, result) pairs for the engine to hand back."""
        first = batch[0]
        if isinstance(first, Marker) and first.resp.sig.kind.multi_tensor:
            return [(first, [])]  # an empty group: nothing to move, the result is an empty list
        if first.resp.sig.plane:
            return self._on_plane(batch)
        return self._table[first.resp.sig.kind](batch)

    def reduction(self, sig: Signature) -> tuple[ReduceOp, float, float]:
        """A reduction batch's op, prescale and postscale factors (Average's divisor, the set's size, folded in)."""
        assert sig.op is not None  # resolved at submit for every reduction
        post = Scale(sig.postscale, self.psets.size(sig.ps_id)) if sig.op is Average else sig.postscale
        return sig.op, sig.prescale, post

    def _root(self, sig: Signature) -> int:
        """A broadcast's root: the job's rank -> the set's (agreed valid)."""
        return self.psets.members(sig.ps_id).index(sig.root)

    def wait(self, request: Any) -> None:
        polling.wait(request)
        self.mpi_calls += 1

    # -- allreduce ------------------------------------------------------------------------------
    def _allreduce(self, items: list[Item]) -> Iterable[tuple[Item, Any]]:
        first = items[0].resp
        comm = self.comm_of(first.sig.ps_id)
        op, pre, post = self.reduction(first.sig)
        if op is Adasum:
            return self._adasum(comm, items, pre, post)
        if deterministic.accumulates(first.sig.extra, items[0].dtype):  # its own Iallreduce applies the factors
            comm = deterministic.AccumulatingComm(comm, self.ops, items[0].dtype, first.sig.extra, pre, post)
            pre, post = 1.0, 1.0
        small: list[Item] = []
        small_bytes = 0
        threshold = self.config.fusion_threshold_bytes
        below = packed_below(threshold, self.config.allreduce_chunk_bytes)
        with self._chunks.batch():  # the batch's chunks travel back to back (engine/chunks.py)
            for item in items:
                nbytes = item.src.nbytes
                if nbytes == 0:
                    if item.dst is None:
                        item.dst = item.src.copy()
                    continue
                if nbytes < below:
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
        ends = np.cumsum([item.src.size for item in items]).tolist()
        bounds = list(zip([0, *ends[:-1]], ends))  # each tensor's [start, end) in the buffer
        buf = np.empty(ends[-1], dtype=work)
        for item, (lo, hi) in zip(items, bounds):
            values = bf16_to_f32(item.src.reshape(-1)) if dtype == "bfloat16" else item.src.reshape(-1)
            np.multiply(values, pre, out=buf[lo:hi], casting="unsafe")
        for item in items:
            self.timeline.begin(item.resp.name, "ADASUM_ALLREDUCE")
        adasum.reduce(comm, self.adasum_levels.levels(comm), buf, bounds, self.ops.op("float64", Sum),
                      self.ops.datatypes["float64"], self.wait)
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
        self._chunks.clear((item.src, None if item.dst is item.src else item.dst))
        if item.dst is None:
            item.dst = aligned_empty(item.src.shape, item.src.dtype)
        if item.dst is not item.src and pre != 1.0:
            tl.begin(item.resp.name, "MEMCPY_IN")
        scaled_copy(item.dst, item.src, item.dtype, pre)  # (out of place: the copy MPI's Iallreduce would make)
        tl.begin(item.resp.name, "MPI_ALLREDUCE")
        self._chunked_allreduce(comm, item.dst.reshape(-1), item.dtype, op, post,
                                functools.partial(tl.end, item.resp.name) if tl.enabled else None)

    def _chunked_allreduce(self, comm: Any, dst: np.ndarray, dtype: str, op: ReduceOp, post: float,
                           on_done: Optional[Callable[[], None]] = None) -> None:
        """Start reducing ``dst`` in place in chunk_bytes pieces; engine/chunks.py completes them."""
        datatype = self.ops.datatypes[dtype]
        mpi_op = self.ops.op(dtype, op)
        step = max(1, self.config.allreduce_chunk_bytes // max(1, dst.itemsize))
        n = dst.shape[0]
        halved = post != 1.0 and op in (Sum, Average) and dtype in ("float32", "float64") and comm.Get_size() == 2 \
            and n >= step and type(comm).__module__ == "mpi4py.MPI"  # chunks.halves (benchmarks/HISTORY)
        for start in range(0, n, step):
            piece = dst[start:start + step]
            if halved:
                steps = halves(comm, piece, post, self._chunks.spares)
                next(steps)  # (its first exchange starts now)
                request, factor = polling.Polled(functools.partial(next, steps, True)), 1.0  # (done: no more steps)
            else:  # non-blocking on every rank: a blocking and a non-blocking collective never match
                request = start_allreduce(comm, self.ops.tree, self.ops.IN_PLACE, piece, datatype, mpi_op, self.wait)
                factor = post
            self._chunks.post(request, piece, dtype, factor, on_done if start + step >= n else None)

    def _fusion_buffer(self, nbytes: int) -> np.ndarray:
        if self._fusion.nbytes < nbytes:
            self._fusion = np.empty(max(nbytes, self.config.fusion_threshold_bytes), dtype=np.uint8)
        return self._fusion[:nbytes]

    def _reduce_small(self, comm: Any, items: list[Item], op: ReduceOp, pre: float, post: float) -> None:
        """Pack, reduce, unpack (a lone tensor: no packing); when no item has an output yet (out-of-place ops) the
        outputs are views of the packed block."""
        if len(items) == 1:
            return self._reduce_direct(comm, items[0], op, pre, post)
        tl = self.timeline
        tracing = tl.enabled
        dtype = items[0].dtype
        store = storage_dtype(dtype)
        total = sum([item.src.size for item in items])  # (lists: no generator call per tensor)
        fresh = all([item.dst is None for item in items])
        buf = aligned_empty((total,), store) if fresh else \
            self._fusion_buffer(total * store.itemsize).view(store)
        self._chunks.clear(item.src for item in items)
        for item in items if tracing else ():
            tl.begin(item.resp.name, "MEMCPY_IN_FUSION_BUFFER")
        flats = [item.src if item.src.ndim == 1 else item.src.reshape(-1) for item in items]  # 1-D: no new view
        np.concatenate(flats, out=buf)
        scale_inplace(buf, dtype, pre)  # (a prescale: elementwise, the bits of scaling each tensor as it goes in)
        for item in items if tracing else ():
            tl.begin(item.resp.name, "MPI_ALLREDUCE")  # (a phase begun ends the one before)
        self._chunked_allreduce(comm, buf, dtype, op, post)
        self._chunks.drain()  # the packed results are copied out (and the fusion buffer reused) next
        offset = 0
        for item, flat in zip(items, flats):
            if tracing:
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
        root = self._root(first.sig)
        is_root = comm.Get_rank() == root
        packed: list[Item] = []
        threshold = self.config.fusion_threshold_bytes
        for item in items:
            if item.dst is None:
                item.dst = aligned_empty(item.src.shape, item.src.dtype)
            if is_root and item.dst is not item.src:
                np.copyto(item.dst, item.src)
            self.timeline.begin(item.resp.name, "MPI_BCAST")
            if item.dst.nbytes < packed_below(threshold, self.config.allreduce_chunk_bytes):
                packed.append(item)
            elif item.dst.nbytes:
                self.wait(comm.Ibcast([item.dst.reshape(-1).view(np.uint8), BYTE], root=root))
        start = 0
        while start < len(packed):  # pack up to the fusion threshold per Bcast
            group: list[Item] = []
            nbytes = 0
            while start < len(packed) and not over_cap(len(group), nbytes, packed[start].dst.nbytes, threshold):
                group.append(packed[start])
                nbytes += packed[start].dst.nbytes
                start += 1
            buf = self._fusion_buffer(nbytes)
            if is_root:
                np.concatenate([item.dst.reshape(-1).view(np.uint8) for item in group], out=buf)
            self.wait(comm.Ibcast([buf, BYTE], root=root))
            offset = 0
            if not is_root:
                for item in group:
                    item.dst.reshape(-1).view(np.uint8)[...] = buf[offset:offset + item.dst.nbytes]
                    offset += item.dst.nbytes
        for item in items:
            self.timeline.end(item.resp.name)
        return [(item, item.dst) for item in items]

    # -- the rest, one response at a time --------------------------------------------------------
    def _barrier(self, items: list[Any]) -> list[tuple[Any, Any]]:
        self.wait(self.comm_of(items[0].resp.sig.ps_id).Ibarrier())
        return [(items[0], None)]

    def _join(self, items: list[Any]) -> list[tuple[Any, Any]]:
        return [(items[0], items[0].resp.last_joined)]

    # -- a data plane's batch ---------------------------------------------------------------------------
    def _on_plane(self, batch: list[Item]) -> list[tuple[Item, Any]]:
        sig = batch[0].resp.sig
        assert self.planes is not None, "a batch names a data plane but the engine has no plane table"
        plane = self.planes.plane(sig.plane, sig.ps_id)
        for item in batch:
            if item.req is None:  # a joined rank stands in with zeros (no rows for allgather)
                item.src = plane.zeros(item.dtype, item.src.shape)
                item.dst = None
            self.timeline.begin(item.resp.name, f"{plane.name.upper()}_{sig.kind.label.upper()}")
        ready = [getattr(item.src, "ready", None) for item in batch]
        plane.wait_ready([event for event in ready if event is not None])
        try:
            results = self._plane_table[sig.kind](plane, batch)
        except (HvdliteError, Stop):  # what ends the engine anyway (a wedged wait inside a plane included)
            raise
        except Exception as exc:  # noqa: BLE001 - the plane's state is unknown: the job ends, as after MPI's error
            if mpi.is_process_failure(exc):  # a lost peer (ULFM), seen by the stall watch of the plane's wait
                raise
            names = ", ".join(sorted({item.resp.name for item in batch}))
            raise HvdliteError(
                f"rank {self.psets.world_rank}: the {plane.name} data plane failed in {sig.kind} of {names}: "
                f"{type(exc).__name__}: {exc}. Every pending and later collective raises this error; fix the "
                f"cause and restart the job (HOROVOD_GPU_OPERATIONS / HOROVOD_CPU_OPERATIONS choose the planes)"
            ) from exc
        finally:
            for item in batch:
                self.timeline.end(item.resp.name)
        return list(zip(batch, results))

    def _plane_allreduce(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        sig = batch[0].resp.sig
        if sig.op is Adasum:
            raise NotImplementedError("hvd.Adasum runs on MPI host buffers only; reduce these tensors with "
                                      "hvd.Average or hvd.Sum, or move them to the CPU")
        op, pre, post = self.reduction(sig)
        outputs = [_payload(item.dst) for item in batch]  # (None: a new tensor)
        if deterministic.accumulates(sig.extra, batch[0].dtype):
            return plane.allreduce_accumulated(_payloads(batch), outputs, batch[0].dtype, sig.extra, pre, post)
        return plane.allreduce(_payloads(batch), outputs, batch[0].dtype, op, pre, post)

    def _plane_allgather(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        all_rows = row_exec.row_counts(self.comm_of(batch[0].resp.sig.ps_id), batch, polling.wait)
        return plane.allgather(_payloads(batch), all_rows.tolist())

    def _plane_broadcast(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        return plane.broadcast(_payloads(batch), [_payload(item.dst) for item in batch], self._root(batch[0].resp.sig))

    def _plane_reducescatter(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        sig = batch[0].resp.sig
        n = self.psets.size(sig.ps_id)
        splits = [deterministic.slices(item.src.shape[0], n) for item in batch]  # as the MPI path's
        return plane.reducescatter(_payloads(batch), batch[0].dtype, *self.reduction(sig), splits)

    def _plane_alltoall(self, plane: DataPlane, batch: list[Item]) -> list[Any]:
        item = batch[0]
        splits, recv = row_exec.splits_of(self.comm_of(item.resp.sig.ps_id), item, polling.wait)
        return [(plane.alltoall(_payload(item.src), [int(s) for s in splits], [int(r) for r in recv]), recv)]


def _payload(buffer: Any) -> Any:
    return getattr(buffer, "payload", buffer)


def _payloads(batch: list[Item]) -> list[Any]:
    return [_payload(item.src) for item in batch]
