"""hvdlite.tensorflow.elastic: Horovod's elastic states for TensorFlow (TensorFlowKerasState, TensorFlowState)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from hvdlite.core.elastic import HostsUpdatedInterrupt, ObjectState, State, run

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "TensorFlowState", "HostsUpdatedInterrupt"]


class _Variables:
    """state_dict()/load_state_dict() over a list of variables (what ObjectState snapshots)."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self.variables = list(variables)

    def state_dict(self) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in self.variables]

    def load_state_dict(self, values: list[np.ndarray]) -> None:
        if len(values) != len(self.variables):
            raise ValueError(f"elastic state: {len(values)} saved variables for {len(self.variables)} here")
        for variable, value in zip(self.variables, values):
            variable.assign(value)


class _KerasModel:
    """A Keras model's weights and its optimizer's variables (built on demand, so a fresh rank can load)."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def _optimizer_variables(self) -> list[Any]:
        if self.optimizer is None:
            return []
        from .keras_families import family_of  # Keras 3 or tf-keras, as the optimizer is

        family = family_of(self.optimizer, "optimizer", "TensorFlowKerasState")
        family.build_optimizer(self.optimizer, self.model.trainable_variables)
        return family.optimizer_variables(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": [np.array(w) for w in self.model.get_weights()],
                "optimizer": _Variables(self._optimizer_variables()).state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.set_weights(state["weights"])
        if state["optimizer"]:
            _Variables(self._optimizer_variables()).load_state_dict(state["optimizer"])


class TensorFlowKerasState(ObjectState):
    """A Keras model (weights), its optimizer (variables) and any other values, e.g. ``epoch=0, batch=0``; also
    Horovod's ``hvd.elastic.KerasState`` (either Keras)."""

    def __init__(self, model: Any, optimizer: Optional[Any] = None, backend: Any = None, **kwargs: Any) -> None:
        from .keras_families import model_family  # refuses a model and optimizer of different Keras

        model_family(model, "KerasState", optimizer)
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(_keras=_KerasModel(model, self.optimizer), **kwargs)


class TensorFlowState(ObjectState):
    """A list of tf.Variables (default: none given means the caller passes ``variables=``) and other values."""

    def __init__(self, variables: Optional[Sequence[Any]] = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = list(variables or [])
        super().__init__(_variables=_Variables(self.variables), **kwargs)
