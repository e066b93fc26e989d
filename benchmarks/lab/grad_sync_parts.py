"""Gradient sync taken apart: grad_sync.py's methods beside the transport driven the way the engine drives it.

    mpiexec -n 2 python benchmarks/lab/grad_sync_parts.py [grad_sync.py's flags, e.g. --methods 'mpi_nb_*']

Added to grad_sync.py's methods (all "diag", never the limit): mpi_fused_copy (copy into one buffer, chunked
Allreduce, copy out: the cost of a fusion buffer), hvdlite_async_sum (hvdlite_async with Sum: no scaling pass);
and the transport's non-blocking collective on the flat buffer in the chunks of --chunk-mb: mpi_nb_wait_*
(Iallreduce + Wait per chunk), mpi_nb_test_* (Iallreduce polled by Test, as the engine polls), mpi_nb_test_avg_*
(the same, each chunk scaled by 1/size after it completes, Average as the engine did per chunk), mpi_nb_pipe_*
and mpi_nb_pipe_avg_* (polled, with as many chunks in flight as the engine keeps: its pipeline without hvdlite),
mpi_nb_pipe_avg_end_* (the same with Average's pass over the whole buffer at the end), mpi_nb_pipe_pre_* (each
chunk divided before it is posted), mpi_nb_pipe_avg_slices(4)_* (each completed chunk divided in 128 KiB (512 KiB)
slices between the polls of the next), mpi_nb_rsag(_avg)_* (Ireduce_scatter + Iallgatherv per chunk, Average's
division on this rank's slice only), mpi_nb_pipe_op_avg_* (mpi_nb_pipe_* with a user-defined MPI op that adds and
halves each sum where it is made: at 2 ranks MPI combines the 2 contributions once per element; MPICH then
reduces the whole chunk on each rank).
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import grad_sync  # noqa: E402
import hvdlite as hvd  # noqa: E402

PIPE_DEPTH = 4  # chunk collectives the engine keeps in flight (hvdlite/core/engine/chunks.py)


class Parts(grad_sync.Bench):
    def all_methods(self) -> dict[str, Callable[[], None]]:
        out = super().all_methods()
        for mb in [float(x) for x in self.args.chunk_mb.split(",") if x]:
            label, step = f"{mb:g}MB", max(1, int(mb * 2 ** 20) // 4)
            out[f"mpi_nb_wait_{label}"] = self._nonblocking(step, "wait", False)
            out[f"mpi_nb_test_{label}"] = self._nonblocking(step, "test", False)
            out[f"mpi_nb_test_avg_{label}"] = self._nonblocking(step, "test", True)
            out[f"mpi_nb_pipe_{label}"] = self._nonblocking(step, "pipe", False)
            out[f"mpi_nb_pipe_avg_{label}"] = self._nonblocking(step, "pipe", True)
            out[f"mpi_nb_pipe_avg_end_{label}"] = self._nonblocking(step, "pipe", True, at_end=True)
            out[f"mpi_nb_pipe_pre_{label}"] = self._nonblocking(step, "pipe", True, before=True)
            out[f"mpi_nb_pipe_avg_slices_{label}"] = self._sliced(step)
            out[f"mpi_nb_pipe_avg_slices4_{label}"] = self._sliced(step, 131072)
            out[f"mpi_nb_rsag_{label}"] = self._scatter_gather(step, False)
            out[f"mpi_nb_rsag_avg_{label}"] = self._scatter_gather(step, True)
            if self.comm.Get_size() == 2:
                out[f"mpi_nb_pipe_op_avg_{label}"] = self._nonblocking(step, "pipe", False, op=_halving_op())
        out["mpi_fused_copy"] = self._fused_copy
        out["hvdlite_async_sum"] = lambda: self._hvd_async(hvd, self.arrays, hvd.Sum, "sum.")
        return out

    def _nonblocking(self, step: int, how: str, scale: bool, at_end: bool = False, before: bool = False,
                     op: Any = None) -> Callable[[], None]:
        """The chunked in-place reduction with Iallreduce: completed by Wait, or polled by Test in a loop
        (as the engine's polling.wait does while a user thread waits); ``how`` "pipe": polled, with the
        engine's chunk pipeline depth (PIPE_DEPTH) outstanding, the oldest completed first; ``scale``:
        each chunk is then multiplied by 1/size (Average's pass) as it completes, before the next starts,
        or (``at_end``) the whole buffer in one pass once every chunk has completed."""
        from mpi4py import MPI
        comm, flat = self.comm, self.flat
        pieces = [flat[i:i + step] for i in range(0, flat.size, step)]
        factor = np.float32(1.0 / comm.Get_size())
        depth = PIPE_DEPTH if how == "pipe" else 1

        def complete(request: Any, piece: np.ndarray) -> None:
            if how == "wait":
                request.Wait()
            else:
                test = request.Test
                while not test():
                    pass
            if scale and not at_end and not before:
                np.multiply(piece, factor, out=piece)

        def run() -> None:
            inflight: list[tuple[Any, np.ndarray]] = []
            for piece in pieces:
                if before:
                    np.multiply(piece, factor, out=piece)
                inflight.append((comm.Iallreduce(MPI.IN_PLACE, [piece, MPI.FLOAT], op=op or MPI.SUM), piece))
                if len(inflight) >= depth:
                    complete(*inflight.pop(0))
            for request, piece in inflight:
                complete(request, piece)
            if scale and at_end:
                np.multiply(flat, factor, out=flat)
        return run

    def _sliced(self, step: int, slice_elems: int = 32768) -> Callable[[], None]:
        """mpi_nb_pipe_avg_*, with Average's pass done in slices of ``slice_elems`` between the polls of the
        chunks still in flight (progressing them meanwhile) instead of after each chunk's completion."""
        from mpi4py import MPI
        comm, flat = self.comm, self.flat
        pieces = [flat[i:i + step] for i in range(0, flat.size, step)]
        factor = np.float32(1.0 / comm.Get_size())
        todo: collections.deque = collections.deque()

        def work() -> bool:
            if not todo:
                return False
            piece = todo.popleft()
            if piece.size > slice_elems:
                todo.appendleft(piece[slice_elems:])
                piece = piece[:slice_elems]
            np.multiply(piece, factor, out=piece)
            return True

        def complete(request: Any, piece: np.ndarray) -> None:
            test = request.Test
            while not test():
                if not work():
                    break
            while not test():
                pass
            while work():  # at most one completed chunk waits (as engine/chunks.py)
                pass
            todo.extend(piece[i:i + slice_elems] for i in range(0, piece.size, slice_elems))

        def run() -> None:
            inflight: collections.deque = collections.deque()
            for piece in pieces:
                inflight.append((comm.Iallreduce(MPI.IN_PLACE, piece, op=MPI.SUM), piece))
                if len(inflight) >= PIPE_DEPTH:
                    complete(*inflight.popleft())
            while inflight:
                complete(*inflight.popleft())
            while work():
                pass
        return run

    def _scatter_gather(self, step: int, scale: bool) -> Callable[[], None]:
        """Each chunk as an in-place Ireduce_scatter (this rank's slice lands at the chunk's start), the slice
        moved to its place (multiplied by 1/size on the way with ``scale``: Average's division over 1/size of
        the bytes, in a copy rank > 0 makes anyway), then an in-place Iallgatherv; pipelined as mpi_nb_pipe_*."""
        from mpi4py import MPI
        comm, flat = self.comm, self.flat
        size, me = comm.Get_size(), comm.Get_rank()
        factor = np.float32(1.0 / size)
        plans = []
        for i in range(0, flat.size, step):
            piece = flat[i:i + step]
            base, extra = divmod(piece.size, size)
            counts = [base + (1 if r < extra else 0) for r in range(size)]
            displs = [sum(counts[:r]) for r in range(size)]
            plans.append((piece, counts, displs))

        def complete(entry: tuple) -> Optional[tuple]:
            stage, request, piece, counts, displs = entry
            test = request.Test
            while not test():
                pass
            if stage == "ag":
                return None
            lo, n = displs[me], counts[me]
            if scale:
                np.multiply(piece[:n], factor, out=piece[lo:lo + n])
            elif lo:
                piece[lo:lo + n] = piece[:n]
            return ("ag", comm.Iallgatherv(MPI.IN_PLACE, [piece, counts, displs, MPI.FLOAT]), piece, counts,
                    displs)

        def run() -> None:
            inflight: collections.deque = collections.deque()
            for piece, counts, displs in plans:
                inflight.append(("rs", comm.Ireduce_scatter(MPI.IN_PLACE, [piece, MPI.FLOAT], counts, op=MPI.SUM),
                                 piece, counts, displs))
                while len(inflight) >= PIPE_DEPTH:
                    nxt = complete(inflight.popleft())
                    if nxt is not None:
                        inflight.append(nxt)
            while inflight:
                nxt = complete(inflight.popleft())
                if nxt is not None:
                    inflight.append(nxt)
        return run

    def _fused_copy(self) -> None:
        """What a fusion buffer costs at best: copy in, chunked in-place Allreduce, copy out."""
        from mpi4py import MPI
        flat, offset, spans = self.flat, 0, []
        for a in self.arrays:
            n = a.size
            np.copyto(flat[offset:offset + n], a.reshape(-1))
            spans.append((a, offset, n))
            offset += n
        step = 2 ** 20 // 4
        for i in range(0, flat.size, step):
            self.comm.Allreduce(MPI.IN_PLACE, flat[i:i + step], op=MPI.SUM)
        for a, off, n in spans:
            np.copyto(a.reshape(-1), flat[off:off + n])


def _halving_op() -> Any:
    """float32 sum, then halved in place (the sum's bits * 0.5, as Average's pass gives them at 2 ranks)."""
    from mpi4py import MPI

    def add_halve(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        b = np.frombuffer(inoutbuf, dtype=np.float32)
        np.add(np.frombuffer(inbuf, dtype=np.float32), b, out=b)
        np.multiply(b, np.float32(0.5), out=b)
    return MPI.Op.Create(add_halve, commute=True)


if __name__ == "__main__":
    grad_sync.main(kind=Parts)
