"""The tf.errors types of hvdlite's collective errors, as a Horovod program on TensorFlow catches them, and the
check of a collective's tensor arguments."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvdlite.core import HvdliteError, InvalidArgumentError, TensorMismatchError
from hvdlite.core.frontend import SUPPORTED_DTYPES

__all__ = ["MismatchError", "ArgumentError", "as_tf_error", "as_tensor", "as_tensors", "as_list"]


class MismatchError(tf.errors.FailedPreconditionError, TensorMismatchError):
    """Ranks disagree on a collective (shape, dtype, op, root, ranks): TensorFlow's FailedPreconditionError,
    as Horovod raises, and still an ``hvd.TensorMismatchError``."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class ArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A collective's argument is invalid on this rank: TensorFlow's InvalidArgumentError, and a ValueError."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def as_tf_error(exc: BaseException) -> BaseException:
    """The TensorFlow error type a Horovod program catches for ``exc`` (``exc`` itself when there is none)."""
    if isinstance(exc, TensorMismatchError):
        return MismatchError(str(exc))
    if isinstance(exc, InvalidArgumentError) or (isinstance(exc, (ValueError, TypeError))
                                                 and not isinstance(exc, HvdliteError)):
        return ArgumentError(str(exc))
    return exc


def as_list(values: Any, what: str) -> list[Any]:
    """A grouped op's tensors as a list; ``what``: the op the user called."""
    if isinstance(values, (tf.Tensor, tf.Variable, str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what}: expected a list of tf.Tensors, got {type(values).__name__}")
    return list(values)


def as_tensor(value: Any, what: str) -> tf.Tensor:
    """``value`` as a tf.Tensor for the collective ``what``; anything else is a TypeError naming ``what``, as a
    Horovod op's type constraint is."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what}: expected a tf.Tensor, got {type(value).__name__}")
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: expected a tf.Tensor, got {type(value).__name__} ({exc})") from exc
    if tensor.dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(f"{what}: tensors of dtype {tensor.dtype.name} are not supported by hvdlite; supported "
                        f"dtypes: {', '.join(SUPPORTED_DTYPES)}")
    return tensor


def as_tensors(values: Any, what: str) -> list[tf.Tensor]:
    """A grouped op's tensors, each as_tensor."""
    return [as_tensor(value, what) for value in as_list(values, what)]
