"""Horovod's naming matrix on numpy arrays: the synchronous and in-place forms of the core's async primitives."""
from __future__ import annotations

from typing import Any, Optional, Sequence, cast

import numpy as np

from .api import (allgather_async, allreduce_async, alltoall_async, broadcast_async, grouped_allgather_async,
                  grouped_allreduce_async, grouped_reducescatter_async, reducescatter_async)
from .engine.handles import Handle
from .process_sets import ProcessSet, global_process_set
from .reduce_ops import Accumulation


def allreduce(array: Any, average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return cast(np.ndarray,
                allreduce_async(array, average, name, op, prescale_factor, postscale_factor, process_set).wait())


def allreduce_(array: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    return cast(np.ndarray, allreduce_async(array, average, name, op, prescale_factor, postscale_factor, process_set,
                           inplace=True).wait())


def allreduce_async_(array: np.ndarray, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    return allreduce_async(array, average, name, op, prescale_factor, postscale_factor, process_set, inplace=True)


def grouped_allreduce(arrays: Sequence[Any], average: Optional[bool] = None, name: Optional[str] = None,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, outputs: Optional[Sequence[Any]] = None,
                      accumulation: Optional[Accumulation] = None) -> list[np.ndarray]:
    handle = grouped_allreduce_async(arrays, average, name, op, prescale_factor, postscale_factor, process_set,
                                     outputs=outputs, accumulation=accumulation)
    return cast("list[np.ndarray]", handle.wait())


def grouped_allreduce_(arrays: Sequence[np.ndarray], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return cast("list[np.ndarray]", grouped_allreduce_async(arrays, average, name, op, prescale_factor,
                                                            postscale_factor, process_set, inplace=True).wait())


def grouped_allreduce_async_(arrays: Sequence[np.ndarray], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    return grouped_allreduce_async(arrays, average, name, op, prescale_factor, postscale_factor,
                                   process_set, inplace=True)


def allgather(array: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    return cast(np.ndarray, allgather_async(array, name, process_set).wait())


def grouped_allgather(arrays: Sequence[Any], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[np.ndarray]:
    return cast("list[np.ndarray]", grouped_allgather_async(arrays, name, process_set).wait())


def broadcast(array: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    return cast(np.ndarray, broadcast_async(array, root_rank, name, process_set).wait())


def broadcast_(array: np.ndarray, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    return cast(np.ndarray, broadcast_async(array, root_rank, name, process_set, inplace=True).wait())


def broadcast_async_(array: np.ndarray, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    return broadcast_async(array, root_rank, name, process_set, inplace=True)


def alltoall(array: Any, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, np.ndarray]:
    return cast("tuple[np.ndarray, np.ndarray]", alltoall_async(array, splits, name, process_set).wait())


def reducescatter(array: Any, name: Optional[str] = None, op: Any = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    return cast(np.ndarray, reducescatter_async(array, name, op, process_set, prescale_factor, postscale_factor).wait())


def grouped_reducescatter(arrays: Sequence[Any], name: Optional[str] = None, op: Any = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[np.ndarray]:
    return cast("list[np.ndarray]", grouped_reducescatter_async(arrays, name, op, process_set, prescale_factor,
                                       postscale_factor).wait())
