"""DistributedGradientTape: a tf.GradientTape whose gradient() returns gradients combined over all ranks."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvdlite.core import Average, ProcessSet, global_process_set
from hvdlite.core.frontend import mixin_class

from .compression import Compression
from .mpi_ops import check_not_xla
from .aggregation import Combiner
from .reduction import gradient_settings


class _DistributedTape:
    """Mixed in front of the wrapped tape's own class, so ``isinstance(tape, tf.GradientTape)`` holds."""

    _hvd: Combiner

    def register_local_source(self, source: Any) -> None:
        """Keep the gradient of ``source`` local: it is not reduced (only scaled, see scale_local_gradients)."""
        self._hvd.local_vars.add(id(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The local gradients, then averaged (or summed, per ``op``) over the ranks of the process set."""
        grads = super().gradient(target, sources, output_gradients,  # type: ignore[misc]
                                 unconnected_gradients=unconnected_gradients)
        check_not_xla("DistributedGradientTape.gradient()")
        out = self._hvd.reduce(tf.nest.flatten(grads), tf.nest.flatten(sources), use_generic_names)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """``gradient()``'s ``(source, gradient)`` pairs split as Horovod's tape does: ``(local, shared)``."""
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients, use_generic_names))
        pairs = list(zip(tf.nest.flatten(sources), grads))
        local = [(s, g) for s, g in pairs if id(s) in self._hvd.local_vars]
        return local, [(s, g) for s, g in pairs if id(s) not in self._hvd.local_vars]


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: type = Compression.none, sparse_as_dense: bool = False,
                            op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` (recorded, or fresh) so that ``gradient()`` combines the gradients of all ranks (Average
    by default), dense ones in one fused allreduce; ``groups``, ``num_groups`` and ``device_*`` are ignored."""
    cls = mixin_class(_DistributedTape, getattr(type(gradtape), "_hvd_base", type(gradtape)))
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd = Combiner(gradient_settings(op, gradient_predivide_factor, groups, compression, sparse_as_dense,
                                           process_set, scale_local_gradients, optimizer=False), graph_locals=False)
    if isinstance(gradtape, _DistributedTape):  # wrapped again: its local sources stay local
        tape._hvd.local_vars |= gradtape._hvd.local_vars
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: type = Compression.none, sparse_as_dense: bool = False,
                                   op: Any = Average, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """Like DistributedGradientTape, but the trainable weights of ``local_layers`` keep local gradients."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    for layer in [local_layers] if hasattr(local_layers, "trainable_weights") else list(local_layers or []):
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape
