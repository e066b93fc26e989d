"""The tf.errors types of hvdlite's collective errors, as a Horovod program on TensorFlow catches them."""
from __future__ import annotations

import tensorflow as tf

from hvdlite.core import HvdliteError, InvalidArgumentError, TensorMismatchError

__all__ = ["MismatchError", "ArgumentError", "as_tf_error"]


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
