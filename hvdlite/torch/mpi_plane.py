"""The CUDA-aware MPI data plane: torch tensors' device buffers handed to MPI directly, without host staging."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from hvdlite.core.frontend import Bootstrap

NAME = "mpi_cuda"
#: dtypes MPI reduces in device memory (MPI has no float16/bfloat16 type: those are staged through the host).
REDUCE_DTYPES = frozenset({"uint8", "int8", "int16", "int32", "int64", "float32", "float64", "bool"})
#: dtypes it moves (allgather, broadcast, alltoall travel as bytes).
MOVE_DTYPES = REDUCE_DTYPES | {"float16", "bfloat16"}
_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.MAX, "max"),
        (dist.ReduceOp.PRODUCT, "product"))


class MPIGroup:
    """The part of a torch ProcessGroup that TorchPlane uses, over MPI on the tensors' own memory; the calls
    block, so they return no torch Work (None)."""

    def __init__(self, boot: Bootstrap) -> None:
        self.boot = boot
        self.comm = boot.buffers()

    def _ready(self, *tensors: torch.Tensor) -> None:
        """The plane's own work on these tensors (copies, scaling) is done before MPI reads or writes them."""
        if tensors[0].is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensors[0].device))
            self.boot.wait(event.query)

    def allreduce(self, tensors: list, options: Any) -> None:
        buf = tensors[0]
        op = next(name for torch_op, name in _OPS if options.reduceOp == torch_op)
        self._ready(buf)
        self.comm.allreduce(buf, str(buf.dtype).replace("torch.", ""), op)

    def _allgather_base(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        self._ready(send, recv)
        self.comm.allgather(send, recv)

    def broadcast(self, tensors: list, options: Any) -> None:
        self._ready(tensors[0])
        self.comm.bcast(tensors[0], options.rootRank)

    def alltoall_base(self, out: torch.Tensor, tensor: torch.Tensor, recv_splits: list, send_splits: list,
                      options: Any) -> None:
        row = math.prod(tensor.shape[1:]) * tensor.element_size()  # bytes per row
        self._ready(tensor, out)
        self.comm.alltoallv(tensor, [s * row for s in send_splits], out, [r * row for r in recv_splits])

    def shutdown(self) -> None:
        self.comm.free()


__all__ = ["MPIGroup", "NAME", "REDUCE_DTYPES", "MOVE_DTYPES"]
