"""horovod.torch.mpi_ops's names: the asynchronous and in-place collectives (.async_ops) and the blocking
collectives with their autograd Functions (.collectives), in one module as Horovod has them."""
from __future__ import annotations

from hvdlite.core import basics
from hvdlite.core.basics import *  # noqa: F403 - the runtime names, listed once in basics.__all__
from hvdlite.core.basics import _basics  # noqa: F401 - Horovod's hvd.mpi_ops._basics

from . import async_ops
from .async_ops import *  # noqa: F401,F403
from .collectives import (HorovodAllgather, HorovodAllreduce, HorovodAlltoall, HorovodBroadcast,  # noqa: F401
                          HorovodGroupedAllgather, HorovodGroupedAllreduce, HorovodReducescatter, allgather,
                          allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
                          grouped_reducescatter, reducescatter)

__all__ = [
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall", "reducescatter",
    "grouped_reducescatter", "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather",
    "HorovodGroupedAllgather", "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
]
__all__ += async_ops.__all__
__all__ += basics.__all__  # (also in async_ops.__all__; named here for type checkers' star imports)
