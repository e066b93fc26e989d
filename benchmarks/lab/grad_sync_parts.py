"""Gradient sync taken apart: grad_sync.py's methods beside the transport driven the way the engine drives it.

    mpiexec -n 2 python benchmarks/lab/grad_sync_parts.py [grad_sync.py's flags, e.g. --methods 'mpi_nb_*']

Added to grad_sync.py's methods (all "diag", never the limit): mpi_fused_copy (copy into one buffer, chunked
Allreduce, copy out: the cost of a fusion buffer), hvdlite_async_sum (hvdlite_async with Sum: no scaling pass);
and the transport's non-blocking collective on the flat buffer in the chunks of --chunk-mb: mpi_nb_wait_*
(Iallreduce + Wait per chunk), mpi_nb_test_* (Iallreduce polled by Test, as the engine polls), mpi_nb_test_avg_*
(the same, each chunk scaled by 1/size after it completes, Average as the engine did per chunk), mpi_nb_pipe_*
and mpi_nb_pipe_avg_* (polled, with as many chunks in flight as the engine keeps: its pipeline without hvdlite),
mpi_nb_pipe_avg_end_* (the same with Average's pass over the whole buffer at the end).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

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
        out["mpi_fused_copy"] = self._fused_copy
        out["hvdlite_async_sum"] = lambda: self._hvd_async(hvd, self.arrays, hvd.Sum, "sum.")
        return out

    def _nonblocking(self, step: int, how: str, scale: bool, at_end: bool = False) -> Callable[[], None]:
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
            if scale and not at_end:
                np.multiply(piece, factor, out=piece)

        def run() -> None:
            inflight: list[tuple[Any, np.ndarray]] = []
            for piece in pieces:
                inflight.append((comm.Iallreduce(MPI.IN_PLACE, piece, op=MPI.SUM), piece))
                if len(inflight) >= depth:
                    complete(*inflight.pop(0))
            for request, piece in inflight:
                complete(request, piece)
            if scale and at_end:
                np.multiply(flat, factor, out=flat)
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


if __name__ == "__main__":
    grad_sync.main(kind=Parts)
