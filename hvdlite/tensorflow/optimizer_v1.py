"""DistributedOptimizer for TF1 optimizers (``tf.compat.v1.train.Optimizer``): reduces in compute_gradients().

As Horovod's, the wrapper is a ``tf.compat.v1.train.Optimizer`` that holds the user's optimizer as
``_optimizer``: ``compute_gradients()`` asks it for the local gradients and returns them combined over the
ranks, and ``apply_gradients()`` is the wrapped optimizer's. ``minimize()`` (the base class' own) calls both,
so it reduces too. It works in a ``tf.compat.v1`` graph (sessions, ``MonitoredTrainingSession``) and eagerly
(``minimize(loss_fn, var_list=...)``). With ``backward_passes_per_step=N`` the gradients are summed locally
and reduced on every N-th call; ``apply_gradients()`` applies them on that call only and otherwise just
advances ``global_step``.
"""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hvdlite.core import ProcessSet

from .aggregation import aggregate, new_state_variable, on_reduced_pass
from .reduction import reduce_partially, variable_names

__all__ = ["DistributedTF1Optimizer", "is_tf1_optimizer"]


def is_tf1_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TF1 optimizer (``tf.compat.v1.train.Optimizer``, e.g. GradientDescentOptimizer)."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


class DistributedTF1Optimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose ``compute_gradients()`` combines the gradients of all ranks (see the module)."""

    def __init__(self, optimizer: Any, settings: dict, name: Optional[str] = None,
                 use_locking: bool = False) -> None:
        super().__init__(use_locking=use_locking, name=name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._hvd_settings = dict(settings)
        self._hvd_local_vars: set = set()
        self._hvd_accumulators: dict = {}
        self._hvd_counter: Optional[tf.Variable] = None

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` local (not reduced; divided by the set size if scale_local_gradients)."""
        self._hvd_local_vars.add(id(var))

    # -- reduction ----------------------------------------------------------------------------------------
    def _hvd_reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        s = self._hvd_settings
        local = [id(v) in self._hvd_local_vars for v in variables]
        names = variable_names([v for v, is_local in zip(variables, local) if not is_local])
        process_set: ProcessSet = s["process_set"]
        return reduce_partially(grads, local, names, s["compression"], s["sparse_as_dense"], s["op"],
                                s["gradient_predivide_factor"], process_set, s["scale_local_gradients"])

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's gradients, combined over the ranks (see Optimizer.compute_gradients)."""
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._hvd_settings["backward_passes_per_step"] == 1:
            reduced = self._hvd_reduce(grads, variables)
        else:
            reduced = self._hvd_aggregate(grads, variables)
        return list(zip(reduced, variables))

    def _hvd_aggregate(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """Sum ``grads`` locally; every N-th call return the reduced sums (aggregation.py)."""
        s = self._hvd_settings
        if self._hvd_counter is None:
            self._hvd_counter = new_state_variable(tf.constant(0, tf.int32), "hvdlite_aggregation_counter")
        for v, g in zip(variables, grads):
            if g is not None and id(v) not in self._hvd_accumulators:
                self._hvd_accumulators[id(v)] = new_state_variable(tf.zeros(v.shape, dtype=v.dtype.base_dtype),
                                                                   "hvdlite_gradient_accumulator")
        accumulators = [self._hvd_accumulators.get(id(v)) for v in variables]
        return aggregate(grads, accumulators, self._hvd_counter, s["backward_passes_per_step"],
                         s["average_aggregated_gradients"],
                         lambda sums, at: self._hvd_reduce(sums, [variables[i] for i in at]))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's apply_gradients (with backward_passes_per_step > 1: only on the calls whose
        compute_gradients reduced; the others only advance ``global_step``)."""
        if self._hvd_settings["backward_passes_per_step"] == 1 or self._hvd_counter is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        pairs = list(grads_and_vars)
        applied = on_reduced_pass(
            self._hvd_counter, [g for g, _ in pairs],
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
