"""hvd.check_replicas for Keras models (their and their optimizers' variables), optimizers and tensors (its callback,
CheckReplicasCallback, is in callbacks.py with the other callbacks)."""
from __future__ import annotations

from typing import Any

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_named_replicas

from ..keras_families import FAMILIES
from ..replicas import check_tensors, named_variables
from .variables import model_and_optimizer_variables


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """Check that ``obj`` (a Keras model with its optimizer's state, a Keras optimizer, or a collection of
    variables, tensors and numpy arrays) is bit-identical on every rank of ``process_set``; returns how many
    tensors were compared. One small gather of 64-bit digests; when any differs, only the first differing
    tensor is gathered and ``hvd.ReplicaDivergenceError`` is raised on every rank naming it, the ranks that
    differ and the largest absolute difference. Every rank must call it. Layers' random-seed state (Dropout)
    is left out: it differs per rank on purpose."""
    if any(family.owns(obj, "model") for family in FAMILIES):  # Keras 3 or tf-keras
        return check_named_replicas(named_variables(model_and_optimizer_variables(obj, build_optimizer=False)),
                                    process_set)
    return check_tensors(obj, process_set)


__all__ = ["check_replicas"]
