"""horovod.torch.mpi_ops's names: the asynchronous and in-place collectives (.async_ops) and the blocking
collectives with their autograd Functions (.collectives), in one module as Horovod has them."""
from __future__ import annotations

from .async_ops import *  # noqa: F401,F403
from .async_ops import __all__ as _ASYNC
from .collectives import (HorovodAllgather, HorovodAllreduce, HorovodAlltoall, HorovodBroadcast,  # noqa: F401
                          HorovodGroupedAllgather, HorovodGroupedAllreduce, HorovodReducescatter, allgather,
                          allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                          grouped_reducescatter, reducescatter)

__all__ = list(_ASYNC) + [
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall", "reducescatter",
    "grouped_reducescatter", "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
    "HorovodGroupedAllgather", "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
]
