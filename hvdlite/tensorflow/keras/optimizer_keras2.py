"""The tf-keras (Keras 2) side of DistributedOptimizer: ``apply_gradients`` reduces the gradients first.

tf-keras' ``model.fit`` and ``optimizer.minimize`` end in ``apply_gradients`` for both optimizer families
(the 2.11+ ``tf.keras.optimizers.*`` and ``tf.keras.optimizers.legacy.*``), so overriding it reduces every
gradient exactly once on every path, as the Keras 3 wrapper's ``apply`` does. (Horovod 0.28 reduced in the
legacy optimizers' ``_compute_gradients``, i.e. in ``minimize``/``fit`` only.) A caller that opts out of the
optimizer's own aggregation (``skip_gradients_aggregation=True``, legacy ``experimental_aggregate_gradients=
False``) reduces the gradients itself, so they are applied as given.
"""
from __future__ import annotations

from typing import Any, Optional

from ..aggregation import on_reduced_pass
from ..mpi_ops import check_not_xla
from ..keras_families import KERAS2
from .optimizer import FAMILY_MIXINS, DistributedOptimizerMixin

__all__ = ["Keras2DistributedOptimizerMixin"]


class Keras2DistributedOptimizerMixin(DistributedOptimizerMixin):
    """tf-keras: ``apply_gradients`` reduces (every ``backward_passes_per_step`` calls), then applies."""

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> list:
        """The legacy optimizers' hook (``minimize()`` calls it, and Horovod's Keras 2 code may): the local
        gradients, reduced over the ranks (with ``backward_passes_per_step=N``: summed locally and reduced on
        every N-th call). ``apply_gradients()`` given exactly these gradients applies them without reducing
        again (with N > 1: on the reducing call only; the others advance ``iterations``)."""
        compute = getattr(super(), "_compute_gradients", None)
        if compute is None:
            raise AttributeError(f"{type(self).__name__} (a tf-keras 2.11+ optimizer) has no _compute_gradients; "
                                 f"use a tf.keras.optimizers.legacy optimizer, or compute the gradients with "
                                 f"tf.GradientTape and call apply_gradients(), which reduces them")
        pairs = list(compute(loss, var_list, grad_loss=grad_loss, tape=tape))
        variables = [v for _, v in pairs]
        reduced = self._hvd.combine([g for g, _ in pairs], variables)
        self._hvd.prepared = [g for g in reduced if g is not None]
        return list(zip(reduced, variables))

    def _hvd_take_prepared(self, grads: list[Any]) -> bool:
        """Whether ``grads`` are the ones ``_compute_gradients`` just returned (already reduced)."""
        present = [g for g in grads if g is not None]
        prepared, self._hvd.prepared = self._hvd.prepared, []
        return bool(present) and len(present) == len(prepared) and all(a is b for a, b in zip(present, prepared))

    def apply_gradients(self, grads_and_vars: Any, name: Optional[str] = None, *args: Any, **kwargs: Any) -> Any:
        """Reduce the gradients over the ranks, then apply them with the wrapped optimizer."""
        pairs = list(grads_and_vars)
        if pairs and self._hvd_take_prepared([g for g, _ in pairs]):
            def plain() -> Any:
                return super(Keras2DistributedOptimizerMixin, self).apply_gradients(  # type: ignore[misc]
                    pairs, name, *args, **kwargs)
            if self._hvd.settings["backward_passes_per_step"] == 1:
                return plain()
            return on_reduced_pass(self._hvd.counter, [g for g, _ in pairs], plain, self._hvd_skip)
        if not pairs or self._hvd_caller_aggregates(args, kwargs):
            return super().apply_gradients(pairs, name, *args, **kwargs)  # type: ignore[misc]
        check_not_xla("DistributedOptimizer.apply_gradients()")

        def apply(reduced: list[Any], on: list[Any]) -> Any:
            return super(Keras2DistributedOptimizerMixin, self).apply_gradients(  # type: ignore[misc]
                list(zip(reduced, on)), name, *args, **kwargs)
        return self._hvd.apply([g for g, _ in pairs], [v for _, v in pairs], apply, self._hvd_skip)

    def _hvd_caller_aggregates(self, args: tuple, kwargs: dict) -> bool:
        """Whether the caller turned the optimizer's own gradient aggregation off."""
        if KERAS2.is_legacy(self):  # apply_gradients(grads_and_vars, name, experimental_aggregate_gradients)
            return not (args[0] if args else kwargs.get("experimental_aggregate_gradients", True))
        return bool(args[0] if args else kwargs.get("skip_gradients_aggregation", False)) or \
            not kwargs.get("experimental_aggregate_gradients", True)


FAMILY_MIXINS[KERAS2] = Keras2DistributedOptimizerMixin
