"""Helpers on variables and Python objects: broadcast_variables, broadcast_object(_fn), allgather_object."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from hvdlite import core
from hvdlite.core import ProcessSet, global_process_set

from .mpi_ops import broadcast_group


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Optional[tf.Operation]:
    """Overwrite every variable with its value on ``root_rank`` (one op for the whole list).

    Works on tf.Variable and Keras 3 variables, eagerly (returns None) or in a tf.function (returns an op).
    ``inplace`` is accepted for Horovod compatibility; the values are always assigned in place.
    """
    variables = list(variables)
    values = broadcast_group(variables, root_rank, process_set=process_set, what="broadcast_variables")
    # in a graph (tf.function or a tf.compat.v1 session), the returned op runs the assignments themselves
    assigned = [v.assign(val, read_value=False) if isinstance(v, tf.Variable) else v.assign(val)
                for v, val in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assigned)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Send any picklable object from ``root_rank`` to every rank of ``process_set``; returns it everywhere."""
    return core.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` each time it is called.

    Horovod builds TF1 placeholders here; in TensorFlow 2 the function calls broadcast_object directly.
    """
    def _broadcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return _broadcast


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather any picklable object from every rank of ``process_set``; returns the list in rank order."""
    return core.allgather_object(obj, name=name, process_set=process_set)
