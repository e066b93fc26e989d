"""Helpers on variables and Python objects: broadcast_variables, broadcast_object(_fn), allgather_object; and for
tf.compat.v1 graphs and sessions, broadcast_global_variables and its SessionRunHook."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from hvdlite import core
from hvdlite.core import ProcessSet, global_process_set

from .mpi_ops import broadcast_group, unchained_collectives


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Optional[tf.Operation]:
    """Overwrite every variable (tf.Variable or Keras 3) with its value on ``root_rank`` in one op: eagerly returns
    None, in a graph the op (``inplace`` is ignored: always in place)."""
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
    """A function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` each time it is called."""
    return functools.partial(broadcast_object, root_rank=root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather any picklable object from every rank of ``process_set``; returns the list in rank order."""
    return core.allgather_object(obj, name=name, process_set=process_set)


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """An op that overwrites every global variable of the tf.compat.v1 graph with its value on ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    with unchained_collectives():  # run on its own: it must not wait for a training step's collectives
        return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A SessionRunHook that runs broadcast_global_variables(``root_rank``) once the session is created."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op: Optional[Any] = None

    def begin(self) -> None:
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
