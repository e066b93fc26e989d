"""Horovod's naming matrix on numpy arrays (the synchronous and in-place forms of the async primitives), and
the collectives on Python objects (cloudpickle over the tensor collectives)."""
from __future__ import annotations

from typing import Any, Optional, Sequence, cast

import cloudpickle
import numpy as np

from .api import (_auto_name, _pset_id, allgather_async, allreduce_async, alltoall_async, broadcast_async,
                  grouped_allgather_async, grouped_allreduce_async, grouped_reducescatter_async, reducescatter_async)
from .engine.handles import Handle
from .process_sets import ProcessSet, global_process_set
from .reduce_ops import Accumulation
from .runtime import state


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


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast any picklable object (cloudpickle) from ``root_rank``; returns it on every rank."""
    name = _auto_name("broadcast_object", name, process_set)
    _pset_id(process_set, "broadcast_object", name)  # raises, naming the set, when it is not registered
    is_root = state().rank == int(root_rank)  # a rank of the whole job, as in Horovod
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8) if is_root else np.empty(0, np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, name + ".size", process_set)
    data = payload if is_root else np.empty(int(length[0]), dtype=np.uint8)
    data = broadcast(data, root_rank, name + ".data", process_set)
    return obj if is_root else cloudpickle.loads(data.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather any picklable object from every rank; returns the list ordered by rank."""
    name = _auto_name("allgather_object", name, process_set)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = allgather(np.array([payload.size], dtype=np.int64), name + ".sizes", process_set)
    data = allgather(payload, name + ".data", process_set)
    bounds = [0, *np.cumsum(sizes).tolist()]
    return [cloudpickle.loads(data[start:end].tobytes()) for start, end in zip(bounds, bounds[1:])]
