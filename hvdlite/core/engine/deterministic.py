"""hvdlite's own rank-order allreduce: reproducible reductions (``deterministic=True``) and float32 accumulation.

Every element's result is ``((x_0 + x_1) + x_2) + ...`` over the set's ranks, whatever buffer, chunk or batch
it travels in: a piece is cut in one slice per rank, an all-to-all gives each rank every rank's part of its slice,
it combines them in rank order, and an all-gather returns the slices (a ring allreduce's bytes). An accumulating
compression has the same shape with float32 sums: every value is rounded once to the wire dtype and once to the
gather dtype, so the error does not grow with the number of ranks. Who uses which: docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..reduce_ops import (FLOAT_DTYPES, HALF_DTYPES, NUMPY_REDUCTION, Accumulation, Max, Min,
                          Product, ReduceOp, Sum, bf16_to_f32, f32_to_bf16, scale_inplace, storage_dtype)
from . import polling
from .mpi import MPIOps, counts_displacements


def applies(dtype: str, op: ReduceOp) -> bool:
    """Whether the order of the reduction can change its bits (floating-point sums and products)."""
    return dtype in FLOAT_DTYPES and op is not Min and op is not Max


def slices(n: int, parts: int) -> list[int]:
    """Elements of each rank's slice of an ``n``-element piece (the first ``n % parts`` one more); also each
    rank's rows of a reducescatter, as Horovod splits them."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def reduce_scatter(comm: Any, send: np.ndarray, counts: list[int], dtype: str, op: ReduceOp, datatype: Any,
                   wait: Callable[[Any], None], out: Optional[np.ndarray] = None) -> np.ndarray:
    """This rank's slice (``counts[rank]`` elements) of the rank-order reduction of every rank's ``send``."""
    store = storage_dtype(dtype)
    received = exchange(comm, send, counts, datatype, store, wait)
    if dtype == "bfloat16":
        combine = NUMPY_REDUCTION[op]  # rounded to bfloat16 after every step, as the MPI path's operator does
        acc = bf16_to_f32(received[0])
        for row in received[1:]:
            acc = bf16_to_f32(f32_to_bf16(combine(acc, bf16_to_f32(row))))
        if out is None:
            return f32_to_bf16(acc)
        out[...] = f32_to_bf16(acc)
        return out
    view = received.view(np.float16) if dtype == "float16" else received
    rows = list(view)
    summed: np.ndarray = rank_order(rows, op, rows[0] if out is None else out.view(view.dtype))
    return summed.view(store) if dtype in HALF_DTYPES else summed


def exchange(comm: Any, send: np.ndarray, counts: list[int], datatype: Any, store: Any,
             wait: Callable[[Any], None]) -> np.ndarray:
    """The rule's all-to-all: every rank's part of this rank's slice, one row per rank."""
    size, mine = comm.Get_size(), counts[comm.Get_rank()]
    received = np.empty((size, mine), dtype=store)
    wait(comm.Ialltoallv([send, counts_displacements(counts), datatype],
                         [received, counts_displacements([mine] * size), datatype]))
    return received


def rank_order(rows: Sequence[Any], op: ReduceOp, out: Any = None) -> Any:
    """``((rows[0] op rows[1]) op rows[2]) ...``, each step rounded to the rows' dtype, into ``out`` (else a new
    array); only the arrays' own operators, so a data plane's framework tensors combine by the same rule."""
    combine: Callable[[Any, Any], Any] = operator.imul if op is Product else operator.iadd
    if out is None:
        if len(rows) == 1:
            return rows[0]
        acc, rest = rows[0] * rows[1] if op is Product else rows[0] + rows[1], rows[2:]
    else:
        if out is not rows[0]:
            out[...] = rows[0]
        acc, rest = out, rows[1:]
    for row in rest:
        acc = combine(acc, row)
    return acc


def plane_slices(plane: Any, rank: int, size: int, flat: Any, reduce: Callable[[list[Any]], Any]) -> Any:
    """The rule's moves on a data plane's 1-D ``flat``: ``reduce(the parts, in rank order)`` between them."""
    counts = slices(int(flat.shape[0]), size)
    mine = counts[rank]
    received = plane.alltoall(flat, counts, [mine] * size)
    reduced = reduce([received[r * mine:(r + 1) * mine] for r in range(size)])
    return plane.allgather([reduced], [[c] for c in counts])[0]


class OrderedComm:
    """A communicator whose floating-point ``Iallreduce`` and ``Ireduce_scatter`` reduce in rank order."""

    def __init__(self, comm: Any, mpi_ops: MPIOps) -> None:
        self.comm = comm
        self._mpi_ops = mpi_ops
        self._kinds = [(mpi_ops.datatypes[d], mpi_ops.op(d, op), d, op) for d in FLOAT_DTYPES for op in (Sum, Product)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def _kind(self, datatype: Any, mpi_op: Any) -> Optional[tuple[str, ReduceOp]]:
        for dt, o, dtype, op in self._kinds:
            if o == mpi_op and dt == datatype:
                return dtype, op
        return None

    def Iallreduce(self, send: Any, recv: list[Any], mpi_op: Any) -> Any:  # noqa: N802 - mpi4py's name
        """The rank-order rule: this rank's slice reduced (reduce_scatter), then the slices all-gathered."""
        kind = self._kind(recv[1], mpi_op)  # recv, send: mpi4py's [buffer, datatype] specs
        if kind is None:
            return self.comm.Iallreduce(send, recv, mpi_op)
        dst, datatype = recv
        counts = slices(dst.shape[0], self.comm.Get_size())
        src = dst.copy() if send is self._mpi_ops.IN_PLACE else send[0]
        mine = reduce_scatter(self.comm, src, counts, *kind, datatype, polling.wait)
        polling.wait(self.comm.Iallgatherv([mine, datatype], [dst, counts_displacements(counts), datatype]))
        return polling.DONE

    def Split(self, color: int, key: int) -> "OrderedComm":  # noqa: N802 - mpi4py's name
        """A sub-communicator (Adasum's tree levels) that reduces in rank order too."""
        return OrderedComm(self.comm.Split(color, key), self._mpi_ops)

    def Ireduce_scatter(self, send: list[Any], recv: list[Any], counts: Any, mpi_op: Any) -> Any:  # noqa: N802
        kind = self._kind(recv[1], mpi_op)
        if kind is None:
            return self.comm.Ireduce_scatter(send, recv, counts, mpi_op)
        dtype, op = kind
        reduce_scatter(self.comm, send[0], list(counts), dtype, op, recv[1], polling.wait, out=recv[0])
        return polling.DONE


def comms(comm_of: Callable[[int], Any], mpi_ops: MPIOps, enabled: bool) -> Callable[[int], Any]:
    """The executor's ``comm_of`` (process set id -> communicator): wrapped in OrderedComms when ``enabled``."""
    wrapped: dict[int, OrderedComm] = {}

    def ordered_comm_of(ps_id: int) -> Any:
        comm = comm_of(ps_id)
        found = wrapped.get(ps_id)
        if found is None or found.comm is not comm:
            found = wrapped[ps_id] = OrderedComm(comm, mpi_ops)
        return found
    return ordered_comm_of if enabled else comm_of


# -- accumulating compressions (reduce_ops.Accumulation): bf16/fp16 on the wire, float32 sums --------------------
def to_wire(values32: np.ndarray, wire: str, scratch: bool = False) -> np.ndarray:
    """float32 values rounded (to nearest even) to the wire dtype, as uint16 bits (``scratch``: see f32_to_bf16)."""
    return values32.astype(np.float16).view(np.uint16) if wire == "float16" else f32_to_bf16(values32, scratch)


def from_wire(bits: np.ndarray, wire: str, out: Optional[np.ndarray] = None) -> np.ndarray:
    """uint16 bits of the wire dtype as float32 (exact), into ``out`` (float32) when given."""
    if wire == "bfloat16":
        return bf16_to_f32(bits, out)
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    np.copyto(out, bits.view(np.float16), casting="unsafe")
    return out


def write(dst: np.ndarray, values32: np.ndarray, dtype: str) -> None:
    """``dst`` (storage of ``dtype``) = float32 ``values32`` rounded once to ``dtype``."""
    if dtype == "bfloat16":
        dst[...] = f32_to_bf16(values32)
    else:
        np.copyto(dst, values32, casting="unsafe")


def accumulating_allreduce(comm: Any, src: np.ndarray, dst: np.ndarray, dtype: str, acc: Accumulation, pre: float,
                           post: float, mpi_ops: MPIOps, wait: Callable[[Any], None]) -> None:
    """``dst`` = ``post`` * the rank-order float32 sum of every rank's ``pre * src`` in the wire dtype, rounded once
    to the gather dtype (then to ``dtype``); ``src`` may be ``dst``."""
    n = dst.shape[0]
    counts = slices(n, comm.Get_size())
    if dtype == acc.wire and pre == 1.0:
        send = src.view(np.uint16)  # already in the wire dtype: its bits go as they are
    elif pre == 1.0:
        wide = from_wire(src, "bfloat16") if dtype == "bfloat16" else src.astype(np.float32, copy=False)
        send = to_wire(wide, acc.wire, scratch=wide is not src)  # a float32 copy made here is scratch
    else:  # Horovod's rounding of a scaled float: float32(double(x) * factor), then the wire's
        wide = from_wire(src, "bfloat16") if dtype == "bfloat16" else src
        send = to_wire((wide.astype(np.float64) * float(pre)).astype(np.float32), acc.wire, True)
    u16 = mpi_ops.datatypes["uint16"]
    received = exchange(comm, send, counts, u16, np.uint16, wait)
    total = from_wire(received[0], acc.wire)
    term = np.empty(received.shape[1], dtype=np.float32)
    for row in received[1:]:  # rank order, in float32: the only order, so every rank gets the same bits
        total += from_wire(row, acc.wire, out=term)
    scale_inplace(total, "float32", post)
    if acc.gather == "float32":
        datatype, part = mpi_ops.datatypes["float32"], total
        direct = dtype == "float32"
        gathered = dst if direct else np.empty(n, dtype=np.float32)
    else:
        datatype, part = u16, to_wire(total, acc.wire, True)
        direct = dtype == acc.wire
        gathered = dst.view(np.uint16) if direct else np.empty(n, dtype=np.uint16)
    wait(comm.Iallgatherv([part, datatype], [gathered, counts_displacements(counts), datatype]))
    if direct:
        return  # gathered straight into dst (the result's dtype is the gather's)
    if acc.gather == "float32":
        write(dst, gathered, dtype)
    elif dtype == "float32":
        from_wire(gathered, acc.wire, out=dst)
    else:
        write(dst, from_wire(gathered, acc.wire), dtype)


class AccumulatingComm:
    """One batch's communicator whose ``Iallreduce`` is ``accumulating_allreduce`` with the batch's factors."""

    def __init__(self, comm: Any, mpi_ops: MPIOps, dtype: str, acc: Accumulation, pre: float, post: float) -> None:
        self.comm = comm
        self._mpi_ops = mpi_ops
        self._dtype = dtype
        self._acc = acc
        self._pre = pre
        self._post = post

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def Iallreduce(self, send: Any, recv: list[Any], mpi_op: Any) -> Any:  # noqa: N802 - mpi4py's name
        dst = recv[0]
        src = dst if send is self._mpi_ops.IN_PLACE else send[0]
        accumulating_allreduce(self.comm, src, dst, self._dtype, self._acc, self._pre, self._post, self._mpi_ops,
                               polling.wait)
        return polling.DONE


def accumulates(extra: Any, dtype: str) -> bool:
    """Whether a batch of ``dtype`` with signature argument ``extra`` reduces by the accumulating rule."""
    return type(extra) is Accumulation and dtype in FLOAT_DTYPES
