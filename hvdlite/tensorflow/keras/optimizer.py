"""DistributedOptimizer: a subclass of the user's optimizer class that reduces gradients first (either Keras), and
load_model, which hands a saved model back with its optimizer wrapped.

Keras 3 reduces in ``apply`` (what ``apply_gradients`` and ``fit`` call), tf-keras in ``apply_gradients`` (both
its optimizer families), each exactly once; a caller that turned the optimizer's own aggregation off reduced them
itself. The class is ``type(name, (mixin, UserOptimizer), ...)``: isinstance and ``get_config`` are the user's.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from hvdlite.core import Average, ProcessSet, global_process_set
from hvdlite.core.frontend import logger, mixin_class

from ..aggregation import Combiner
from ..compression import Compression
from ..keras_families import KERAS2, KERAS3, family_of, same_family, tf_keras_family
from ..mpi_ops import check_not_xla
from ..reduction import gradient_settings


class DistributedOptimizerMixin:
    """What a distributed optimizer class of either Keras family adds in front of the wrapped optimizer class."""

    _hvd_base: type
    _hvd_settings: dict = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hvd = Combiner(dict(type(self)._hvd_settings), graph_locals=False)  # never saved with the optimizer

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` local (not reduced; divided by the set size if scale_local_gradients)."""
        self._hvd.local_vars.add(id(var))

    @property
    def _agg_helper(self) -> Optional[Combiner]:
        """Horovod's name for the aggregation state (``.counter``); None without ``backward_passes_per_step``."""
        return self._hvd if self._hvd.settings["backward_passes_per_step"] > 1 else None

    def _hvd_skip(self) -> Any:
        """A backward pass that only added to the sums: the step count moves on."""
        return self.iterations.assign_add(1)  # type: ignore[attr-defined]


class Keras3DistributedOptimizerMixin(DistributedOptimizerMixin):
    """Keras 3: ``apply`` (which ``apply_gradients`` calls) reduces the gradients."""

    def _hvd_apply_plain(self, grads: list[Any], variables: list[Any]) -> Any:
        return super(DistributedOptimizerMixin, self).apply(grads, variables)  # type: ignore[misc]

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        """Reduce ``grads`` over the ranks (every ``backward_passes_per_step`` calls), then apply them."""
        check_not_xla("DistributedOptimizer.apply()")
        grads = list(grads)
        if not grads or (trainable_variables is None and not self.built):  # type: ignore[attr-defined]
            return super().apply(grads, trainable_variables)  # type: ignore[misc]  # (unbuilt: Keras' own error)
        variables = list(self._trainable_variables if trainable_variables is None  # type: ignore[attr-defined]
                         else trainable_variables)
        KERAS3.build_optimizer(self, variables)  # built outside the cond of backward_passes_per_step
        return self._hvd.apply(grads, variables, self._hvd_apply_plain, self._hvd_skip)


class Keras2DistributedOptimizerMixin(DistributedOptimizerMixin):
    """tf-keras: ``apply_gradients`` reduces (every ``backward_passes_per_step`` calls), then applies."""

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> list:
        """Horovod's hook (legacy ``minimize()`` calls it): the gradients combined, which ``apply_gradients()``
        then applies without reducing again."""
        compute = getattr(super(), "_compute_gradients", None)
        if compute is None and grad_loss is not None:
            raise ValueError(f"{type(self).__name__} (a tf-keras 2.11+ optimizer): _compute_gradients takes no "
                             f"grad_loss; compute the gradients with tf.GradientTape and call apply_gradients()")
        pairs = list(compute(loss, var_list, grad_loss=grad_loss, tape=tape) if compute is not None
                     else super().compute_gradients(loss, var_list, tape=tape))  # type: ignore[misc]
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
            return self._hvd.on_reduced([g for g, _ in pairs], plain, self._hvd_skip)
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


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: type = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras 3 or tf-keras optimizer so it combines gradients over ranks (``op``: Average, Sum or
    Adasum) before applying: a new optimizer of a subclass of ``type(optimizer)``, from its ``get_config()``.
    With ``backward_passes_per_step=N`` the other steps only advance ``iterations``; ``groups``, ``device_*``
    are ignored."""
    settings = gradient_settings(op, gradient_predivide_factor, groups, compression, sparse_as_dense, process_set,
                                 scale_local_gradients, backward_passes_per_step, average_aggregated_gradients)
    family = family_of(optimizer, "optimizer", "DistributedOptimizer")
    if family is not tf_keras_family():  # legitimate, but mostly a mix-up that compile() reports obscurely
        logger.warning(f"DistributedOptimizer: wrapping a {family.name} optimizer ({type(optimizer).__module__}."
                       f"{type(optimizer).__name__}) while tf.keras is {tf_keras_family().name}; a model compiled "
                       f"with it must be {family.name} too (TF_USE_LEGACY_KERAS=1 before TensorFlow's import makes "
                       f"tf.keras tf-keras; `import keras` is always Keras 3)")
    base = getattr(type(optimizer), "_hvd_base", type(optimizer))
    mixin = Keras2DistributedOptimizerMixin if family is KERAS2 else Keras3DistributedOptimizerMixin
    cls = mixin_class(mixin, base, _hvd_settings=dict(settings))
    registered = keras.saving.get_registered_name(base)  # Keras 3's registry (a tf-keras class: its own name)
    if registered != base.__name__:  # a registered custom optimizer: save under its registered name too
        from keras.src.saving import object_registration
        object_registration.GLOBAL_CUSTOM_NAMES[cls] = registered
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)  # type: ignore[attr-defined]


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression: type = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: Any = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A DistributedOptimizer whose ``local_layers`` (a Keras layer or a list) keep their own gradients."""
    family = family_of(optimizer, "optimizer", "PartialDistributedOptimizer")
    single = family.owns(local_layers, "layer") or not isinstance(local_layers, (list, tuple, type(None)))
    layers = [local_layers] if single else list(local_layers or [])
    for layer in layers:  # each a layer of the optimizer's Keras
        layer_family = family_of(layer, "layer", "PartialDistributedOptimizer: local_layers must be Keras layers; each")
        same_family("PartialDistributedOptimizer", ("optimizer", optimizer, family),
                    ("local layer", layer, layer_family))
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for layer in layers:
        for weight in layer.trainable_weights:
            wrapped.register_local_var(weight)
    return wrapped


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[dict] = None, compression: type = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a saved model; its optimizer comes back as a DistributedOptimizer with the state saved with it.

    A ``.keras`` file loads with Keras 3, anything else with the Keras ``tf.keras`` is; ``legacy_opts`` (tf-keras
    only) loads the optimizer as its ``tf.keras.optimizers.legacy`` class."""
    family = KERAS3 if str(filepath).endswith(".keras") else tf_keras_family()
    if legacy_opts and family is KERAS3:
        logger.debug("load_model: legacy_opts=True ignored (Keras 3 has no legacy optimizers)")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
        objects.setdefault(family.module().saving.get_registered_name(cls), cls)
    model = family.load_model(filepath, objects, legacy_opts)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or isinstance(optimizer, DistributedOptimizerMixin):
        return model
    # the loaded optimizer keeps its restored (tf-keras: maybe still pending) state: it becomes the distributed one
    wrapped = DistributedOptimizer(optimizer, compression=compression)
    optimizer.__class__ = type(wrapped)
    optimizer._hvd = wrapped._hvd
    return model
