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

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from hvdlite.core import ProcessSet

from .mpi_ops import dense
from .reduction import reduce_partially, variable_names

__all__ = ["DistributedTF1Optimizer", "is_tf1_optimizer"]


def is_tf1_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a TF1 optimizer (``tf.compat.v1.train.Optimizer``, e.g. GradientDescentOptimizer)."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


def _new_state_variable(initial: Any, name: str) -> tf.Variable:
    """A non-trainable variable outside any function or cond branch being built; in a graph it is a local
    variable (initialised by ``local_variables_initializer`` / a MonitoredTrainingSession, never saved)."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return tf.Variable(initial, trainable=False, name=name)
        return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _after(dependencies: Sequence[Any], make: Callable[[], Any]) -> Any:
    """``make()``, built after ``dependencies`` (a no-op ordering when executing eagerly)."""
    with tf.control_dependencies([d for d in dependencies if d is not None]):
        return make()


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
        """Add ``grads`` to this rank's sums; on every N-th call return the reduced sums (averaged over the N
        passes if average_aggregated_gradients) and start again, otherwise return the sums so far."""
        steps = self._hvd_settings["backward_passes_per_step"]
        if self._hvd_counter is None:
            self._hvd_counter = _new_state_variable(tf.constant(0, tf.int32), "hvdlite_aggregation_counter")
        counter = self._hvd_counter
        present = [i for i, g in enumerate(grads) if g is not None]
        for i in present:
            v = variables[i]
            if id(v) not in self._hvd_accumulators:
                self._hvd_accumulators[id(v)] = _new_state_variable(
                    tf.zeros(v.shape, dtype=v.dtype.base_dtype), "hvdlite_gradient_accumulator")
        accumulators = [self._hvd_accumulators[id(variables[i])] for i in present]

        def clear() -> tf.Tensor:
            zeroed = [acc.assign(tf.zeros_like(acc), read_value=False) for acc in accumulators]
            return _after(zeroed, lambda: tf.constant(0))

        cleared = tf.cond(tf.equal(counter.read_value(), 0), clear, lambda: tf.constant(0))
        added = _after([cleared], lambda: [acc.assign_add(tf.cast(dense(grads[i]), acc.dtype), read_value=False)
                                           for i, acc in zip(present, accumulators)])
        count = _after(added, lambda: counter.assign_add(1, read_value=False))
        passes = _after([count], counter.read_value)

        def reduce_sums() -> list[tf.Tensor]:
            sums: list[Any] = [acc.read_value() for acc in accumulators]
            if self._hvd_settings["average_aggregated_gradients"]:
                sums = [g / tf.cast(steps, g.dtype) for g in sums]
            reduced = self._hvd_reduce(sums, [variables[i] for i in present])
            reset = _after([dense(r) for r in reduced], lambda: counter.assign(0, read_value=False))
            return _after([reset], lambda: [tf.identity(dense(r)) for r in reduced])

        def keep_sums() -> list[tf.Tensor]:
            return [acc.read_value() for acc in accumulators]

        outs = tf.cond(passes >= steps, reduce_sums, keep_sums)
        result: list[Any] = [None] * len(grads)
        for i, out in zip(present, tf.nest.flatten(outs)):
            result[i] = out
        return result

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> Any:
        """The wrapped optimizer's apply_gradients (with backward_passes_per_step > 1: only on the calls whose
        compute_gradients reduced; the others only advance ``global_step``)."""
        if self._hvd_settings["backward_passes_per_step"] == 1 or self._hvd_counter is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        pairs = list(grads_and_vars)
        counter = self._hvd_counter

        def apply() -> tf.Tensor:
            return _after([self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)],
                          lambda: tf.constant(True))

        def skip() -> tf.Tensor:
            step = None if global_step is None else global_step.assign_add(1, read_value=False)
            return _after([step], lambda: tf.constant(False))

        # read the counter after compute_gradients() has updated it (the gradients depend on that update)
        just_reduced = _after([g for g, _ in pairs if g is not None],
                              lambda: tf.equal(counter.read_value(), 0))
        applied = tf.cond(just_reduced, apply, skip)
        return applied if tf.executing_eagerly() else tf.group(applied, name=name)

    # -- the wrapped optimizer's own state ------------------------------------------------------------------
    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
