"""bf16/fp16 on the wire, float32 sums: the allreduce of an accumulating compression (reduce_ops.Accumulation).

The shape is deterministic=True's (engine/deterministic.py): slices, an all-to-all, rank-order sums (here in
float32 whatever the wire dtype, then scaled and rounded once), an all-gather. Every contribution is rounded once
to the wire dtype and every result once to the gather dtype, so the error does not grow with the number of ranks.
A batch whose signature names an Accumulation reduces through an AccumulatingComm (engine/execution.py), a data
plane's through planes.accumulated_allreduce.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..reduce_ops import ACCUMULABLE_DTYPES, Accumulation, scale_inplace
from . import polling
from .deterministic import exchange, slices
from .mpi import MPIOps, counts_displacements


def to_wire(values32: np.ndarray, wire: str, scratch: bool = False) -> np.ndarray:
    """float32 values rounded (to nearest even) to the wire dtype, as uint16 bits; ``scratch``: ``values32`` is
    this module's own temporary, which the bfloat16 rounding may overwrite (no whole-buffer temporaries)."""
    if wire == "float16":
        return values32.astype(np.float16).view(np.uint16)
    nan = np.isnan(values32)  # before the rounding below, which can carry a NaN's bits into infinity
    bits = values32.view(np.uint32)
    work = bits if scratch else bits.copy()
    carry = np.right_shift(bits, 16)
    np.bitwise_and(carry, 1, out=carry)
    carry += 0x7FFF  # round half to even: 0x7FFF, plus 1 where the kept part is odd
    work += carry
    np.right_shift(work, 16, out=work)
    out = work.astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_wire(bits: np.ndarray, wire: str, out: Optional[np.ndarray] = None) -> np.ndarray:
    """uint16 bits of the wire dtype as float32 (exact), into ``out`` (float32) when given."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    if wire == "bfloat16":
        np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, bits.view(np.float16), casting="unsafe")
    return out


def write(dst: np.ndarray, values32: np.ndarray, dtype: str) -> None:
    """``dst`` (storage of ``dtype``) = float32 ``values32`` rounded once to ``dtype``."""
    if dtype == "bfloat16":
        dst[...] = to_wire(values32, "bfloat16")
    else:
        np.copyto(dst, values32, casting="unsafe")


def allreduce(comm: Any, src: np.ndarray, dst: np.ndarray, dtype: str, acc: Accumulation, pre: float,
              post: float, mpi_ops: MPIOps, wait: Callable[[Any], None]) -> None:
    """``dst`` = ``post`` * the rank-order float32 sum over ``comm`` of every rank's ``pre * src`` rounded to
    the wire dtype, rounded once to the gather dtype (then to ``dtype``); ``src`` may be ``dst`` (in place)."""
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
    """One batch's communicator (one dtype, one signature): its ``Iallreduce`` is ``allreduce`` above with
    the batch's factors, which the executor then leaves at 1; every other call goes to the wrapped one."""

    def __init__(self, comm: Any, mpi_ops: MPIOps, dtype: str, acc: Accumulation, pre: float, post: float) -> None:
        self.comm, self._mpi_ops = comm, mpi_ops
        self._dtype, self._acc, self._pre, self._post = dtype, acc, pre, post

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def Iallreduce(self, send: Any, recv: list[Any], mpi_op: Any) -> Any:  # noqa: N802 - mpi4py's name
        dst = recv[0]
        src = dst if send is self._mpi_ops.IN_PLACE else send[0]
        allreduce(self.comm, src, dst, self._dtype, self._acc, self._pre, self._post, self._mpi_ops, polling.wait)
        return polling.DONE


def accumulates(extra: Any, dtype: str) -> bool:
    """Whether a batch of ``dtype`` with signature argument ``extra`` reduces by this rule, over MPI or a plane:
    ``extra`` names an Accumulation and the dtype is floating point."""
    return type(extra) is Accumulation and dtype in ACCUMULABLE_DTYPES


__all__ = ["AccumulatingComm", "accumulates", "allreduce", "from_wire", "to_wire", "write"]
