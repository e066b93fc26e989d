"""DistributedOptimizer: a subclass of the user's optimizer class that reduces gradients first (either Keras).

Keras 3's ``model.fit`` (TensorFlow backend) calls ``optimizer.apply_gradients`` -> ``optimizer.apply``
inside a tf.function; custom loops call either. The Keras 3 wrapper overrides ``apply`` only, so every path
reduces the gradients exactly once (tf-keras: ``apply_gradients``, see optimizer_keras2.py). The class is built
on the fly as ``type(name, (mixin, UserOptimizer), ...)``, so ``isinstance(opt, keras.optimizers.Adam)``
holds, ``get_config`` is the plain optimizer's config and a saved model loads back with plain Keras (as the
plain optimizer) or with ``hvd.load_model`` (wrapped).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from hvdlite.core import Average, ProcessSet, global_process_set
from hvdlite.core.frontend import logger, mixin_class

from ..aggregation import Combiner
from ..compression import Compression
from ..keras_families import KERAS3, Family, family_of, same_family, tf_keras_family
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
        """Horovod's name for the aggregation state (``_agg_helper.counter``: the backward passes summed since
        the last reduction); None without ``backward_passes_per_step``."""
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
        if not grads:
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        if trainable_variables is None:
            if not self.built:  # type: ignore[attr-defined]
                return super().apply(grads, trainable_variables)  # type: ignore[misc]  # Keras raises its own error
            variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        else:
            variables = list(trainable_variables)
        if not self.built:  # type: ignore[attr-defined]  # built outside the cond of backward_passes_per_step
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(variables)  # type: ignore[attr-defined]
        return self._hvd.apply(grads, variables, self._hvd_apply_plain, self._hvd_skip)


#: The distributed mixin of each Keras family but Keras 3's (optimizer_keras2.py adds tf-keras' on import).
FAMILY_MIXINS: dict[Family, type] = {}


def distributed_class(base: type, settings: dict, family: Optional[Family] = None) -> type:
    """The distributed subclass of optimizer class ``base`` (of Keras ``family``) with these hvdlite settings."""
    mixin = FAMILY_MIXINS[family] if family is not None and family is not KERAS3 else Keras3DistributedOptimizerMixin
    cls = mixin_class(mixin, base, _hvd_settings=dict(settings))
    registered = keras.saving.get_registered_name(base)  # Keras 3's registry (a tf-keras class: its own name)
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
    """Wrap a Keras 3 or tf-keras optimizer (SGD, Adam, ..., tf.keras.optimizers.legacy.*) so it averages
    gradients over ranks before applying.

    Returns a new optimizer of a subclass of ``type(optimizer)`` built from ``optimizer.get_config()``.
    ``op`` is hvd.Average (default), hvd.Sum or hvd.Adasum (the gradients are combined with Adasum, which
    needs a power-of-two number of ranks; do not scale the learning rate by the number of ranks). With
    ``backward_passes_per_step=N`` gradients are summed locally (averaged if ``average_aggregated_gradients``)
    and reduced and applied every N-th step; the other steps only advance ``optimizer.iterations``.
    ``groups``, ``device_*`` are accepted and ignored.
    """
    settings = gradient_settings(op, gradient_predivide_factor, groups, compression, sparse_as_dense, process_set,
                                 scale_local_gradients, backward_passes_per_step, average_aggregated_gradients)
    family = family_of(optimizer, "optimizer", "DistributedOptimizer")
    if family is not tf_keras_family():  # legitimate, but mostly a mix-up that compile() reports obscurely
        logger.warning(f"DistributedOptimizer: wrapping a {family.name} optimizer ({type(optimizer).__module__}."
                       f"{type(optimizer).__name__}) while tf.keras is {tf_keras_family().name}; a model compiled "
                       f"with it must be {family.name} too (TF_USE_LEGACY_KERAS=1 before TensorFlow's import makes "
                       f"tf.keras tf-keras; `import keras` is always Keras 3)")
    base = getattr(type(optimizer), "_hvd_base", type(optimizer))
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return distributed_class(base, settings, family).from_config(config)  # type: ignore[attr-defined]


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression: type = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: Any = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A DistributedOptimizer whose ``local_layers`` (a Keras layer or a list of them) keep their own
    gradients: those are not reduced, only divided by the set size if ``scale_local_gradients``."""
    family = family_of(optimizer, "optimizer", "PartialDistributedOptimizer")
    if local_layers is None:
        local_layers = []
    elif family.owns(local_layers, "layer") or not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    layers = list(local_layers)
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

