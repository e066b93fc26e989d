"""Which Keras variables hvdlite synchronizes (a model's and its optimizer's, or those of every live model), and
hvd.check_replicas for TensorFlow (its callback, CheckReplicasCallback, is in callbacks.py)."""
from __future__ import annotations

import gc
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from hvdlite import core
from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_named_replicas, flatten_tensors

from ..functions import broadcast_variables
from ..keras_families import FAMILIES, model_family

#: Random-number state of layers such as Dropout: left per rank, so ranks keep drawing different masks.
_RNG_STATE_NAME = "seed_generator_state"


def model_and_optimizer_variables(model: Any, build_optimizer: bool = True) -> list[Any]:
    """The model's variables, then its optimizer's (building the optimizer's state first if asked)."""
    family = model_family(model, "hvdlite (the model and its optimizer)")
    variables = [v for v in model.variables if getattr(v, "name", "") != _RNG_STATE_NAME]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if build_optimizer and model.built:
            family.build_optimizer(optimizer, model.trainable_variables)
        if family.optimizer_built(optimizer):
            variables += family.optimizer_variables(optimizer)
    return list({id(v): v for v in variables}.values())  # each once, where it came first


def broadcast_global_variables(root_rank: int) -> None:
    """Broadcast the variables of every live Keras model (and its optimizer), of either Keras, from ``root_rank``,
    in model-name order, once every rank is seen to hold the same, uniquely named variables."""
    gc.collect()
    found: dict[int, tuple[Any, str]] = {}  # id -> (variable, its name), each variable once
    for family in (f for f in FAMILIES if f.available()):
        model_classes = family.kinds()["model"]
        models = sorted((o for o in gc.get_objects() if isinstance(o, model_classes)), key=lambda m: m.name)
        for model in models:
            for v in model_and_optimizer_variables(model):
                found.setdefault(id(v), (v, getattr(v, "path", None) or v.name))  # Keras 3: path; tf-keras: name
    variables = [v for v, _ in found.values()]
    signature = [(key, tuple(v.shape), str(v.dtype)) for v, key in found.values()]
    everyone = core.allgather_object(signature)
    for other_rank, other in enumerate(everyone):
        if other != signature:
            mine = set(signature)
            theirs = set(other)
            raise ValueError(
                f"broadcast_global_variables: rank {core.rank()} and rank {other_rank} hold different Keras "
                f"variables (only here: {sorted(mine - theirs)[:5]}, only there: {sorted(theirs - mine)[:5]}); "
                f"build the same models on every rank, or call hvd.broadcast_variables(model.variables, "
                f"root_rank) on the variables you mean")
    paths = [path for path, _, _ in signature]
    twins = sorted({path for path in paths if paths.count(path) > 1})
    if twins:
        raise ValueError(
            f"broadcast_global_variables: several live Keras variables share the names {twins[:5]}, so they "
            f"cannot be matched across ranks (two models with one name?); give models distinct names or call "
            f"hvd.broadcast_variables(model.variables + model.optimizer.variables, root_rank)")
    broadcast_variables(variables, root_rank)


def _leaf(value: Any) -> Optional[np.ndarray]:
    if isinstance(value, (tf.Variable, tf.Tensor)) or hasattr(value, "numpy") and hasattr(value, "dtype") \
            and hasattr(value, "shape") and not isinstance(value, np.ndarray):
        array = np.asarray(value.numpy())
        return array.astype(np.float32) if array.dtype.name == "bfloat16" else array  # exact widening
    return None


def _named(variables: list) -> list:
    """(name, numpy array) for each variable (Keras 3's path, else its name)."""
    return [(getattr(v, "path", None) or v.name, _leaf(v)) for v in variables]


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """hvd.check_replicas of a Keras model with its optimizer's state (not layers' seed state, which differs
    per rank on purpose), a Keras optimizer, or a collection of variables, tensors and numpy arrays."""
    if any(family.owns(obj, "model") for family in FAMILIES):  # Keras 3 or tf-keras
        named = _named(model_and_optimizer_variables(obj, build_optimizer=False))
    elif hasattr(obj, "apply_gradients") and hasattr(obj, "variables"):  # an optimizer
        named = _named(list(obj.variables() if callable(obj.variables) else obj.variables))
    else:
        named = flatten_tensors(obj, _leaf)
    return check_named_replicas(named, process_set)
