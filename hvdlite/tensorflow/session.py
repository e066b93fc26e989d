"""TF1-style (tf.compat.v1 graph and session) helpers: broadcast_global_variables and its SessionRunHook."""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from .functions import broadcast_variables
from .mpi_ops import unchained_collectives


def broadcast_global_variables(root_rank: int) -> tf.Operation:
    """An op that overwrites every global variable of the current tf.compat.v1 graph with its value on
    ``root_rank`` (run it in a session). As in Horovod, this raises RuntimeError in eager mode, where
    TensorFlow keeps no global variable collection: broadcast your model's variables instead."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    with unchained_collectives():  # run on its own: it must not wait for a training step's collectives
        return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A SessionRunHook (for ``tf.compat.v1.train.MonitoredTrainingSession`` and friends) that broadcasts every
    global variable from ``root_rank`` once the session is created, so all ranks start from the same values
    (random initialisation or a restored checkpoint on the root). ``device`` places the op, as in Horovod."""

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
