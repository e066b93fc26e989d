"""The framework-agnostic core of hvdlite: runtime, engine and collectives on numpy arrays.

The names exported here are the public API (``import hvdlite as hvd``): the runtime names every frontend
re-exports (``hvdlite.core.basics``) and the collectives on numpy arrays. Frontends use these and
``hvdlite.core.frontend``; every other module of the core is private.
"""
from __future__ import annotations

from . import basics
from .api import (allgather_async, allreduce_async, alltoall_async, barrier, broadcast_async, grouped_allgather_async,
                  grouped_allreduce_async, grouped_reducescatter_async, join, poll, reducescatter_async, synchronize)
from .basics import *  # noqa: F403 - the runtime names, listed once in basics.__all__
from .basics import engine_stats
from .config import Config
from .horovod_forms import (allgather, allreduce, allreduce_, allreduce_async_, alltoall, broadcast, broadcast_,
                            broadcast_async_, grouped_allgather, grouped_allreduce, grouped_allreduce_,
                            grouped_allreduce_async_, grouped_reducescatter, reducescatter, allgather_object,
                            broadcast_object)
from .replicas import check_replicas

__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "broadcast_object",
    "allgather_object", "engine_stats", "Config", "check_replicas",
]
__all__ += basics.__all__
