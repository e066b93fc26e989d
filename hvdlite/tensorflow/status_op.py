"""The op that raises collective errors inside tf.function (HvdliteCheckStatus): its registration and error store.

``tf.numpy_function`` turns any Python exception into UnknownError or InvalidArgumentError, so a graph-mode
collective stores its error under a token (:func:`defer_error`) and returns the token; this op, registered through
TensorFlow's stable C API with a ctypes kernel, fails with the stored error for any token but 0. Where that API
cannot be loaded, :func:`available` is False and the errors stay PyFunc's.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from hvdlite.core import TensorMismatchError
from hvdlite.core.frontend import logger

from .errors import as_tf_error

OP_NAME = "HvdliteCheckStatus"

__all__ = ["OP_NAME", "defer_error", "available", "numpy_function", "gate"]

# -- a ctypes binding of TensorFlow's stable C API (ops.h, kernels.h) for an op whose kernel is a Python function --
INTERNAL = 13  # a TF_Code (tensorflow/c/tf_status.h)

_VOIDP = ctypes.c_void_p
_CREATE = ctypes.CFUNCTYPE(_VOIDP, _VOIDP)
_COMPUTE = ctypes.CFUNCTYPE(None, _VOIDP, _VOIDP)
_DELETE = ctypes.CFUNCTYPE(None, _VOIDP)
#: NULL kernel create and delete functions (the op's kernel keeps no state): see make_kernel.
NO_CREATE, NO_DELETE = _CREATE(), _DELETE()

#: (argtypes, restype) of every C function used; all live in libtensorflow_framework.
_SIGNATURES = {
    "TF_NewStatus": ([], _VOIDP),
    "TF_DeleteStatus": ([_VOIDP], None),
    "TF_SetStatus": ([_VOIDP, ctypes.c_int, ctypes.c_char_p], None),
    "TF_GetCode": ([_VOIDP], ctypes.c_int),
    "TF_Message": ([_VOIDP], ctypes.c_char_p),
    "TF_NewOpDefinitionBuilder": ([ctypes.c_char_p], _VOIDP),
    "TF_OpDefinitionBuilderAddInput": ([_VOIDP, ctypes.c_char_p], None),
    "TF_OpDefinitionBuilderSetIsStateful": ([_VOIDP, ctypes.c_bool], None),
    "TF_RegisterOpDefinition": ([_VOIDP, _VOIDP], None),
    "TF_NewKernelBuilder": ([ctypes.c_char_p, ctypes.c_char_p, _CREATE, _COMPUTE, _DELETE], _VOIDP),
    "TF_RegisterKernelBuilder": ([ctypes.c_char_p, _VOIDP, _VOIDP], None),
    "TF_GetInput": ([_VOIDP, ctypes.c_int, ctypes.POINTER(_VOIDP), _VOIDP], None),
    "TF_OpKernelContext_Failure": ([_VOIDP, _VOIDP], None),
    "TF_TensorData": ([_VOIDP], _VOIDP),
    "TF_TensorByteSize": ([_VOIDP], ctypes.c_size_t),
    "TF_DeleteTensor": ([_VOIDP], None),
}


def load() -> ctypes.CDLL:
    """libtensorflow_framework with the argument and result types of every C function used set."""
    lib_dir = tf.sysconfig.get_lib()
    names = [n for n in os.listdir(lib_dir) if n.startswith("libtensorflow_framework.so")
             or n.startswith("libtensorflow_framework.") and n.endswith(".dylib")]
    if not names:
        raise OSError(f"no libtensorflow_framework library in {lib_dir}")
    lib = ctypes.CDLL(os.path.join(lib_dir, sorted(names)[0]))
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)  # AttributeError if this TensorFlow lacks the symbol
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def fail(lib: ctypes.CDLL, ctx: int, code: int, message: str) -> None:
    status = lib.TF_NewStatus()
    try:
        lib.TF_SetStatus(status, code, message.encode("utf-8", "replace"))
        lib.TF_OpKernelContext_Failure(ctx, status)
    finally:
        lib.TF_DeleteStatus(status)


def make_kernel(lib: ctypes.CDLL, op_name: str, take_error: Callable[[int], Optional[tuple[int, str]]]) -> object:
    """The C compute callback of op ``op_name``'s kernel (keep it alive): fails with ``take_error(token)`` for a
    nonzero token. No create or delete callback: TensorFlow calls those under its own locks, where a Python
    callback waiting for the GIL can deadlock (tf.random.set_seed)."""

    def compute(_kernel: int, ctx: int) -> None:
        status = lib.TF_NewStatus()
        try:
            tensor = _VOIDP()
            lib.TF_GetInput(ctx, 0, ctypes.byref(tensor), status)
            if lib.TF_GetCode(status) != 0:
                lib.TF_OpKernelContext_Failure(ctx, status)
                return
            try:
                if lib.TF_TensorByteSize(tensor) != 8:
                    raise ValueError("the token input is not an int64 scalar")
                token = ctypes.c_int64.from_address(lib.TF_TensorData(tensor)).value
            finally:
                lib.TF_DeleteTensor(tensor)
            error = take_error(token) if token else None
            if token and error is None:
                error = (INTERNAL, f"{op_name}: no error stored under token {token} (was the step run twice?)")
            if error is not None:
                fail(lib, ctx, *error)
        except BaseException as exc:  # never let an exception die in a C callback
            fail(lib, ctx, INTERNAL, f"{op_name} kernel: {exc!r}")
        finally:
            lib.TF_DeleteStatus(status)

    return _COMPUTE(compute)


def check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if lib.TF_GetCode(status) != 0:
        raise RuntimeError(f"{what}: {lib.TF_Message(status).decode(errors='replace')}")


_lock = threading.Lock()  # registration
_errors_lock = threading.Lock()  # the stored errors (taken by the kernel on TensorFlow's threads)
_state: dict[str, object] = {}  # "compute" (kept alive for the process), "ok", "why"
_errors: dict[int, tuple[int, str]] = {}  # token -> (TF_Code, message), consumed by the kernel
_tokens = itertools.count(1)


def defer_error(code: int, message: str) -> int:
    """Store an error for the HvdliteCheckStatus op downstream; returns the token the op will look up."""
    with _errors_lock:
        token = next(_tokens)
        _errors[token] = (int(code), message)
    return token


def _take_error(token: int) -> Optional[tuple[int, str]]:
    with _errors_lock:
        return _errors.pop(token, None)


def _register() -> None:
    lib = load()
    _state["compute"] = compute = make_kernel(lib, OP_NAME, _take_error)  # kept (with lib) for the process' life
    status = lib.TF_NewStatus()
    try:
        builder = lib.TF_NewOpDefinitionBuilder(OP_NAME.encode())
        lib.TF_OpDefinitionBuilderAddInput(builder, b"token: int64")
        lib.TF_OpDefinitionBuilderSetIsStateful(builder, True)
        lib.TF_RegisterOpDefinition(builder, status)  # frees the builder
        check(lib, status, f"registering op {OP_NAME}")
        kernel = lib.TF_NewKernelBuilder(OP_NAME.encode(), b"CPU", NO_CREATE, compute, NO_DELETE)
        lib.TF_RegisterKernelBuilder(f"{OP_NAME}Cpu".encode(), kernel, status)  # takes the builder
        check(lib, status, f"registering the CPU kernel of {OP_NAME}")
    finally:
        lib.TF_DeleteStatus(status)
    tf.no_gradient(OP_NAME)


@tf.autograph.experimental.do_not_convert  # first called while a tf.function traces: AutoGraph would convert
def available() -> bool:                  # the kernel's callbacks, and run its machinery in every kernel call
    """Whether the op is registered in this process (registers it on the first call)."""
    with _lock:
        if "ok" not in _state:
            try:
                _register()
                _state["ok"] = True
            except Exception as exc:  # another TensorFlow build: callers keep today's behaviour
                _state["ok"], _state["why"] = False, f"{type(exc).__name__}: {exc}"
                logger.debug("hvdlite.tensorflow: %s op unavailable (%s); in tf.function, collective errors "
                             "surface as InvalidArgumentError/UnknownError", OP_NAME, _state["why"])
        return bool(_state["ok"])


def numpy_function(body: Callable[..., list[np.ndarray]], inputs: Sequence[tf.Tensor],
                   out_dtypes: Sequence[tf.DType], name: str) -> list[tf.Tensor]:
    """``tf.numpy_function(body, ...)`` (stateful) in the current graph, followed by HvdliteCheckStatus so
    that ``body``'s mismatch and argument errors fail the step as FailedPrecondition / InvalidArgument."""
    if not available():  # PyFunc maps the errors to InvalidArgument (ValueError, TypeError) or Unknown
        outs: Any = tf.numpy_function(body, list(inputs), list(out_dtypes), stateful=True, name=name)
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]
    placeholders = [np.empty(0, np.dtype(d.as_numpy_dtype)) for d in out_dtypes]

    def deferring(*arrays: np.ndarray) -> list[np.ndarray]:
        """body's outputs after token 0, or the token of its error and empty placeholders."""
        try:
            return [np.int64(0)] + list(body(*arrays))
        except (TensorMismatchError, ValueError, TypeError) as exc:
            converted = as_tf_error(exc)
            if converted is exc:
                raise
            return [np.int64(defer_error(converted.error_code, str(exc)))] + placeholders

    raw = tf.numpy_function(deferring, list(inputs), [tf.int64] + list(out_dtypes), stateful=True, name=name)
    return gate(raw[0], raw[1:], name=name + "Status")


def gate(token: tf.Tensor, values: Sequence[tf.Tensor], name: str) -> list[tf.Tensor]:
    """In the current graph: ``values`` (passed on by one IdentityN, sharing their buffers) once ``token``
    (an int64 scalar) is 0; any other token fails the step with the error stored under it."""
    from tensorflow.python.framework import op_def_library
    op = op_def_library._apply_op_helper(OP_NAME, name=name, token=token)[2]
    if not values:
        return []
    with tf.control_dependencies([op]):
        return list(tf.identity_n(list(values), name=name + "Pass"))
