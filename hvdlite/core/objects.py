"""Collectives on arbitrary Python objects, serialised with cloudpickle over the tensor collectives."""
from __future__ import annotations

from typing import Any, Optional

import cloudpickle
import numpy as np

from .api import _auto_name, _pset_id
from .horovod_forms import allgather, broadcast
from .process_sets import ProcessSet, global_process_set
from .runtime import state


# -- Python objects -----------------------------------------------------------------------------------
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
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
