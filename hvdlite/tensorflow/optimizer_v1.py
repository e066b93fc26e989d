"""DistributedOptimizer for TF1 optimizers (``tf.compat.v1.train.Optimizer``): reduces in compute_gradients()."""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from .aggregation import Combiner, on_reduced_pass

__all__ = ["DistributedTF1Optimizer"]


class DistributedTF1Optimizer(tf.compat.v1.train.Optimizer):
    """As Horovod's: holds the user's optimizer as ``_optimizer``; ``compute_gradients()`` (and so ``minimize()``)
    returns the gradients combined over the ranks (docs/tensorflow.md, TF1)."""

    def __init__(self, optimizer: Any, settings: dict, name: Optional[str] = None,
                 use_locking: bool = False) -> None:
        super().__init__(use_locking=use_locking, name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._hvd = Combiner(dict(settings), graph_locals=True)

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` local (not reduced; divided by the set size if scale_local_gradients)."""
        self._hvd.local_vars.add(id(var))

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, combined over the ranks (see Optimizer.compute_gradients)."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        variables = [v for _, v in pairs]
        return list(zip(self._hvd.combine([g for g, _ in pairs], variables), variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's apply_gradients (N > 1: on reducing calls; the others advance ``global_step``)."""
        if self._hvd.counter is None:  # backward_passes_per_step == 1, or nothing computed yet
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        pairs = list(grads_and_vars)
        applied = on_reduced_pass(
            self._hvd.counter, [g for g, _ in pairs],
            lambda: self._optimizer.apply_gradients(pairs, global_step=global_step, name=name),
            lambda: None if global_step is None else global_step.assign_add(1, read_value=False))
        return applied if tf.executing_eagerly() else tf.group(applied, name=name)

    # -- the wrapped optimizer's own state ------------------------------------------------------------------
    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
