"""The two Keras families hvdlite.tensorflow(.keras) serves, Keras 3 and tf-keras (Keras 2), told apart per object.

Everything that differs between them is one method of a ``Family``; the rest of the Keras frontend is written
once. tf-keras is never imported here: an object of it exists only once its user imported it.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import keras

__all__ = ["Family", "KERAS3", "KERAS2", "FAMILIES", "family_of", "same_family", "model_family", "tf_keras_family"]


class Family:
    """Keras 3 (``keras``): optimizers build their state with ``build()`` and list it in ``.variables``."""

    name = "Keras 3"

    def module(self) -> Any:
        return keras

    def optimizer_classes(self) -> tuple[type, ...]:
        return (keras.optimizers.Optimizer,)

    def kinds(self) -> dict:
        k = self.module()
        return {"optimizer": self.optimizer_classes(), "model": (k.Model,), "layer": (k.layers.Layer,)}

    def available(self) -> bool:
        return True

    def owns(self, obj: Any, kind: str) -> bool:
        return self.available() and isinstance(obj, self.kinds()[kind])

    def optimizer_built(self, optimizer: Any) -> bool:
        return bool(getattr(optimizer, "built", False))

    def build_optimizer(self, optimizer: Any, variables: Sequence[Any]) -> None:
        if not self.optimizer_built(optimizer):
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(list(variables))

    def optimizer_variables(self, optimizer: Any) -> list[Any]:
        return list(optimizer.variables)

    def velocities(self, optimizer: Any) -> list[Any]:
        """SGD's momentum buffers (empty if it has none yet)."""
        return [v for v in getattr(optimizer, "momentums", None) or [] if v is not None]

    def load_model(self, filepath: Any, custom_objects: dict, legacy_opts: bool) -> Any:
        return keras.models.load_model(filepath, custom_objects=custom_objects)


class _TfKeras(Family):
    """tf-keras 2 (``tf.keras`` with TF_USE_LEGACY_KERAS=1): the 2.11+ optimizers and ``optimizers.legacy``."""

    name = "tf-keras (Keras 2)"

    def module(self) -> Any:
        import tf_keras

        return tf_keras

    def optimizer_classes(self) -> tuple[type, ...]:
        k = self.module()
        return (k.optimizers.Optimizer, k.optimizers.legacy.Optimizer)

    def available(self) -> bool:
        return "tf_keras" in sys.modules  # no object of it exists before its import

    def is_legacy(self, optimizer: Any) -> bool:
        return isinstance(optimizer, self.module().optimizers.legacy.Optimizer)

    def optimizer_built(self, optimizer: Any) -> bool:
        if self.is_legacy(optimizer):
            return bool(self.optimizer_variables(optimizer))
        return bool(getattr(optimizer, "_built", False))

    def build_optimizer(self, optimizer: Any, variables: Sequence[Any]) -> None:
        if self.is_legacy(optimizer):
            optimizer._create_all_weights(list(variables))  # creates only what is missing
        elif not getattr(optimizer, "_built", False):
            optimizer.build(list(variables))

    def optimizer_variables(self, optimizer: Any) -> list[Any]:
        found = optimizer.variables  # a property (a callable list) on the 2.11+ optimizers, a method on legacy
        return list(found) if isinstance(found, list) else list(found())

    def velocities(self, optimizer: Any) -> list[Any]:
        if not self.is_legacy(optimizer):
            return super().velocities(optimizer)
        return [slots["momentum"] for slots in getattr(optimizer, "_slots", {}).values() if "momentum" in slots]

    def load_model(self, filepath: Any, custom_objects: dict, legacy_opts: bool) -> Any:
        k = self.module()
        if legacy_opts:  # Horovod: load the saved optimizer as its tf.keras.optimizers.legacy class
            for name in ("SGD", "Adam", "Adagrad", "Adadelta", "Adamax", "Nadam", "RMSprop", "Ftrl"):
                for key in (name, name.lower()):  # tf-keras looks built-in optimizers up in lower case
                    custom_objects.setdefault(key, getattr(k.optimizers.legacy, name))
        return k.models.load_model(filepath, custom_objects=custom_objects)


KERAS3 = Family()
KERAS2 = _TfKeras()
FAMILIES = (KERAS3, KERAS2)
_KIND_WORDS = {
    "optimizer": "a keras.optimizers.Optimizer (Keras 3), or a tf.keras.optimizers.Optimizer or "
                 "tf.keras.optimizers.legacy.Optimizer (tf-keras, with TF_USE_LEGACY_KERAS=1)",
    "model": "a keras.Model (Keras 3) or a tf.keras.Model (tf-keras, with TF_USE_LEGACY_KERAS=1)",
    "layer": "a keras.layers.Layer (Keras 3) or a tf.keras.layers.Layer (tf-keras, with TF_USE_LEGACY_KERAS=1)"}


def family_of(obj: Any, kind: str, what: str) -> Family:
    """The Keras family ``obj`` (an optimizer, model or layer, as ``kind`` says) belongs to; ``what`` names the
    caller in the error for anything else."""
    for family in FAMILIES:
        if family.owns(obj, kind):
            return family
    raise ValueError(f"{what} needs {_KIND_WORDS[kind]}; got {type(obj).__module__}.{type(obj).__name__}")


def same_family(what: str, first: tuple[str, Any, Family], second: tuple[str, Any, Family]) -> Family:
    """``first``'s family, after checking that ``second`` (each a (role, object, family)) is of the same one."""
    (role_a, obj_a, fam_a), (role_b, obj_b, fam_b) = first, second
    if fam_a is not fam_b:
        raise ValueError(
            f"{what}: the {role_a} ({type(obj_a).__module__}.{type(obj_a).__name__}) is {fam_a.name} but the "
            f"{role_b} ({type(obj_b).__module__}.{type(obj_b).__name__}) is {fam_b.name}; one program uses one "
            f"Keras: with TF_USE_LEGACY_KERAS=1 (set before TensorFlow is imported) tf.keras is tf-keras, so build "
            f"both from tf.keras, or both from `import keras` (Keras 3) without it")
    return fam_a


def model_family(model: Any, what: str, optimizer: Optional[Any] = None) -> Family:
    """The family of ``model``, refusing an optimizer (given, or the model's own) of the other family."""
    family = family_of(model, "model", what)
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if optimizer is not None:
        same_family(what, ("model", model, family), ("optimizer", optimizer, family_of(optimizer, "optimizer", what)))
    return family


def tf_keras_family() -> Family:
    """The family ``tf.keras`` stands for in this process, from the classes it hands out (``from tensorflow.keras
    import ...`` rewrites their module name)."""
    import tensorflow as tf

    model = tf.keras.Model  # resolves tf.keras' lazy loader (which imports tf_keras when it stands for it)
    if KERAS2.available() and isinstance(model, type) and issubclass(model, KERAS2.module().Model):
        return KERAS2
    return KERAS3
