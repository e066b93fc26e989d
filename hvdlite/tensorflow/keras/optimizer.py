"""DistributedOptimizer for Keras 3: a subclass of the user's optimizer class that reduces gradients first.

Keras 3's ``model.fit`` (TensorFlow backend) calls ``optimizer.apply_gradients`` -> ``optimizer.apply``
inside a tf.function; custom loops call either. The wrapper overrides ``apply`` only, so every path reduces
the gradients exactly once. The class is built on the fly as ``type(name, (mixin, UserOptimizer), ...)``,
so ``isinstance(opt, keras.optimizers.Adam)`` holds, ``get_config`` is the plain optimizer's config and a
saved model loads back with plain Keras (as the plain optimizer) or with ``hvd.load_model`` (wrapped).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import tensorflow as tf

from hvdlite.core import Adasum, Average, ProcessSet, Sum, global_process_set
from hvdlite.core.frontend import check_gradient_options, mixin_class

from ..compression import Compression
from ..mpi_ops import check_not_xla, dense
from ..reduction import reduce_partially, variable_names


class _HvdState:
    """Per-optimizer hvdlite state, kept off Keras' variable tracking (it is never saved)."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.local_vars: set = set()
        self.accumulators: dict = {}
        self.counter: Optional[tf.Variable] = None


class DistributedOptimizerMixin:
    """The methods a distributed optimizer class adds in front of the wrapped optimizer class."""

    _hvd_base: type
    _hvd_settings: dict = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hvd = _HvdState(dict(type(self)._hvd_settings))

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` local (not reduced; divided by the set size if scale_local_gradients)."""
        self._hvd.local_vars.add(id(var))

    def build(self, variables: Sequence[Any]) -> None:
        super().build(variables)  # type: ignore[misc]
        if self._hvd.settings["backward_passes_per_step"] > 1:
            with tf.init_scope():  # created once, outside any tf.function being traced
                for v in variables:
                    self._hvd.accumulators[id(v)] = tf.Variable(tf.zeros(v.shape, dtype=v.dtype), trainable=False,
                                                                name="hvdlite_gradient_accumulator")
                self._hvd.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdlite_backward_passes")

    def _hvd_reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        s = self._hvd.settings
        local = [id(v) in self._hvd.local_vars for v in variables]
        names = variable_names([v for v, is_local in zip(variables, local) if not is_local])
        return reduce_partially(grads, local, names, s["compression"], s["sparse_as_dense"], s["op"],
                                s["gradient_predivide_factor"], s["process_set"], s["scale_local_gradients"])

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        """Reduce ``grads`` over the ranks (every ``backward_passes_per_step`` calls), then apply them."""
        check_not_xla("DistributedOptimizer.apply()")
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        if trainable_variables is None:
            if not self.built:  # type: ignore[attr-defined]
                return super().apply(grads, trainable_variables)  # Keras raises its own error
            variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        else:
            variables = list(trainable_variables)
        if self._hvd.settings["backward_passes_per_step"] == 1:
            return super().apply(self._hvd_reduce(grads, variables), variables)  # type: ignore[misc]
        if not self.built:  # type: ignore[attr-defined]
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(variables)
        return self._hvd_accumulate_and_apply(grads, variables)

    def _hvd_accumulate_and_apply(self, grads: list[Any], variables: list[Any]) -> Any:
        s = self._hvd.settings
        steps = s["backward_passes_per_step"]
        accumulators = [self._hvd.accumulators[id(v)] for v in variables]
        for g, acc in zip(grads, accumulators):
            if g is not None:
                acc.assign_add(tf.cast(dense(g), acc.dtype))
        counter = self._hvd.counter
        counter.assign_add(1)

        def reduce_and_apply() -> tf.Tensor:
            summed = [None if g is None else acc.read_value() for g, acc in zip(grads, accumulators)]
            if s["average_aggregated_gradients"]:
                summed = [None if g is None else g / steps for g in summed]
            super(DistributedOptimizerMixin, self).apply(self._hvd_reduce(summed, variables), variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))
            counter.assign(0)
            return tf.constant(True)

        def only_count() -> tf.Tensor:
            self.iterations.assign_add(1)  # type: ignore[attr-defined]
            return tf.constant(False)

        return tf.cond(counter.read_value() >= steps, reduce_and_apply, only_count)


def distributed_class(base: type, settings: dict) -> type:
    """The distributed subclass of optimizer class ``base`` with these hvdlite settings."""
    cls = mixin_class(DistributedOptimizerMixin, base, _hvd_settings=dict(settings))
    registered = keras.saving.get_registered_name(base)
    if registered != base.__name__:  # a registered custom optimizer: save under its registered name too
        try:
            from keras.src.saving import object_registration
            object_registration.GLOBAL_CUSTOM_NAMES[cls] = registered
        except (ImportError, AttributeError):  # pragma: no cover - other Keras layouts: load with custom_objects
            pass
    return cls


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: type = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras 3 optimizer (SGD, Adam, AdamW, ...) so it averages gradients over ranks before applying.

    Returns a new optimizer of a subclass of ``type(optimizer)`` built from ``optimizer.get_config()``.
    ``op`` is hvd.Average (default), hvd.Sum or hvd.Adasum (the gradients are combined with Adasum, which
    needs a power-of-two number of ranks; do not scale the learning rate by the number of ranks). With ``backward_passes_per_step=N`` gradients are summed
    locally (averaged if ``average_aggregated_gradients``) and reduced and applied every N-th step; the
    other steps only advance ``optimizer.iterations``. ``groups``, ``device_*`` are accepted and ignored.
    """
    reduce_op, backward_passes_per_step = check_gradient_options(op, gradient_predivide_factor,
                                                                 backward_passes_per_step)
    if reduce_op not in (Average, Sum, Adasum):
        raise ValueError(f"op currently only supports hvd.Average, hvd.Sum and hvd.Adasum, got {reduce_op!r}")
    if groups is not None and not (isinstance(groups, list) or int(groups) > 0):
        raise ValueError("groups must be a positive integer or a list of lists of variables")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), got "
                         f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    base = getattr(type(optimizer), "_hvd_base", type(optimizer))
    settings = dict(compression=compression, sparse_as_dense=bool(sparse_as_dense), op=reduce_op,
                    gradient_predivide_factor=float(gradient_predivide_factor),
                    backward_passes_per_step=int(backward_passes_per_step),
                    average_aggregated_gradients=bool(average_aggregated_gradients), process_set=process_set,
                    scale_local_gradients=bool(scale_local_gradients))
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return distributed_class(base, settings).from_config(config)


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression: type = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: Any = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A DistributedOptimizer whose ``local_layers`` (a Keras layer or a list of them) keep their own
    gradients: those are not reduced, only divided by the set size if ``scale_local_gradients``."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    layers = list(local_layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(f"local_layers must be Keras layers (keras.layers.Layer), got {type(layer).__name__}")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            wrapped.register_local_var(weight)
    return wrapped


def copy_optimizer_state(source: Any, target: Any, trainable_variables: Sequence[Any]) -> None:
    """Build ``target`` on ``trainable_variables`` and give it ``source``'s slot variables and step count."""
    if not getattr(source, "built", False):
        return
    if not target.built:
        with keras.name_scope(target.name, caller=target):
            target.build(list(trainable_variables))
    if len(source.variables) != len(target.variables):
        raise ValueError(f"cannot carry the state of optimizer {source.name!r} over: it has "
                         f"{len(source.variables)} variables, the distributed one {len(target.variables)}")
    for src, dst in zip(source.variables, target.variables):
        dst.assign(src)
