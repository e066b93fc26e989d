"""The tf.errors types of collective errors, and the op that raises them inside tf.function (HvdliteCheckStatus).

TensorFlow's PyFunc kernel (behind ``tf.numpy_function``) turns any Python exception into UnknownError or
InvalidArgumentError, so a graph-mode collective cannot raise ``FailedPreconditionError`` itself. Instead its
Python body stores the error under a token (:func:`defer_error`) and returns the token; this op, registered
once per process through TensorFlow's stable C API (``tensorflow/c/ops.h``, ``kernels.h``) with ctypes
callbacks, receives the token and the collective's results: token 0 passes the results through unchanged,
any other token fails the kernel with the stored error's code and message. Nothing is compiled: the kernel
is a Python function TensorFlow calls through a C function pointer. Collectives (:func:`numpy_function`) give
the op the token alone and pass their results on through an IdentityN that depends on it (:func:`gate`):
the Python kernel costs tens of microseconds per tensor it would pass through. Where the C API cannot be loaded
(another TensorFlow build, a missing symbol, registration refused), :func:`available` is False and callers
keep raising from the Python body (one debug log line says why).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvdlite.core import HvdliteError, InvalidArgumentError, TensorMismatchError
from hvdlite.core.frontend import logger

OP_NAME = "HvdliteCheckStatus"
#: TF_Code values (tensorflow/c/tf_status.h).
INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
INTERNAL = 13



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


_VOIDP = ctypes.c_void_p
_CREATE = ctypes.CFUNCTYPE(_VOIDP, _VOIDP)
_COMPUTE = ctypes.CFUNCTYPE(None, _VOIDP, _VOIDP)
_DELETE = ctypes.CFUNCTYPE(None, _VOIDP)
_SHAPE = ctypes.CFUNCTYPE(None, _VOIDP, _VOIDP)

#: (argtypes, restype) of every C function used; all live in libtensorflow_framework.
_SIGNATURES = {
    "TF_NewStatus": ([], _VOIDP),
    "TF_DeleteStatus": ([_VOIDP], None),
    "TF_SetStatus": ([_VOIDP, ctypes.c_int, ctypes.c_char_p], None),
    "TF_GetCode": ([_VOIDP], ctypes.c_int),
    "TF_Message": ([_VOIDP], ctypes.c_char_p),
    "TF_NewOpDefinitionBuilder": ([ctypes.c_char_p], _VOIDP),
    "TF_OpDefinitionBuilderAddAttr": ([_VOIDP, ctypes.c_char_p], None),
    "TF_OpDefinitionBuilderAddInput": ([_VOIDP, ctypes.c_char_p], None),
    "TF_OpDefinitionBuilderAddOutput": ([_VOIDP, ctypes.c_char_p], None),
    "TF_OpDefinitionBuilderSetIsStateful": ([_VOIDP, ctypes.c_bool], None),
    "TF_OpDefinitionBuilderSetShapeInferenceFunction": ([_VOIDP, _SHAPE], None),
    "TF_RegisterOpDefinition": ([_VOIDP, _VOIDP], None),
    "TF_ShapeInferenceContextNumInputs": ([_VOIDP], ctypes.c_int64),
    "TF_NewShapeHandle": ([], _VOIDP),
    "TF_DeleteShapeHandle": ([_VOIDP], None),
    "TF_ShapeInferenceContextGetInput": ([_VOIDP, ctypes.c_int, _VOIDP, _VOIDP], None),
    "TF_ShapeInferenceContextSetOutput": ([_VOIDP, ctypes.c_int, _VOIDP, _VOIDP], None),
    "TF_NewKernelBuilder": ([ctypes.c_char_p, ctypes.c_char_p, _CREATE, _COMPUTE, _DELETE], _VOIDP),
    "TF_RegisterKernelBuilder": ([ctypes.c_char_p, _VOIDP, _VOIDP], None),
    "TF_NumInputs": ([_VOIDP], ctypes.c_int),
    "TF_GetInput": ([_VOIDP, ctypes.c_int, ctypes.POINTER(_VOIDP), _VOIDP], None),
    "TF_SetOutput": ([_VOIDP, ctypes.c_int, _VOIDP, _VOIDP], None),
    "TF_OpKernelContext_Failure": ([_VOIDP, _VOIDP], None),
    "TF_TensorData": ([_VOIDP], _VOIDP),
    "TF_TensorByteSize": ([_VOIDP], ctypes.c_size_t),
    "TF_DeleteTensor": ([_VOIDP], None),
}

_lock = threading.Lock()  # registration
_errors_lock = threading.Lock()  # the stored errors (taken by the kernel on TensorFlow's threads)
_state: Dict[str, object] = {}  # "lib", "callbacks" (kept alive for the process), "ok", "why"
_errors: Dict[int, Tuple[int, str]] = {}  # token -> (TF_Code, message), consumed by the kernel
_tokens = itertools.count(1)


def defer_error(code: int, message: str) -> int:
    """Store an error for the HvdliteCheckStatus op downstream; returns the token the op will look up."""
    with _errors_lock:
        token = next(_tokens)
        _errors[token] = (int(code), message)
    return token


def _take_error(token: int) -> Optional[Tuple[int, str]]:
    with _errors_lock:
        return _errors.pop(token, None)


def _load() -> ctypes.CDLL:
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


def _fail(lib: ctypes.CDLL, ctx: int, code: int, message: str) -> None:
    status = lib.TF_NewStatus()
    try:
        lib.TF_SetStatus(status, code, message.encode("utf-8", "replace"))
        lib.TF_OpKernelContext_Failure(ctx, status)
    finally:
        lib.TF_DeleteStatus(status)


def _make_callbacks(lib: ctypes.CDLL) -> List[object]:
    """The C callbacks of the op and kernel (returned so the caller keeps them alive forever)."""

    def shape(ctx: int, status: int) -> None:
        # output i has the shape of input i + 1 (input 0 is the token)
        handle = lib.TF_NewShapeHandle()
        try:
            for i in range(1, int(lib.TF_ShapeInferenceContextNumInputs(ctx))):
                lib.TF_ShapeInferenceContextGetInput(ctx, i, handle, status)
                if lib.TF_GetCode(status) != 0:
                    return
                lib.TF_ShapeInferenceContextSetOutput(ctx, i - 1, handle, status)
                if lib.TF_GetCode(status) != 0:
                    return
        except BaseException as exc:  # never let an exception die in a C callback
            lib.TF_SetStatus(status, INTERNAL, f"{OP_NAME} shape function: {exc!r}".encode())
        finally:
            lib.TF_DeleteShapeHandle(handle)

    def create(_construction: int) -> Optional[int]:
        return None

    def compute(_kernel: int, ctx: int) -> None:
        status = lib.TF_NewStatus()
        try:
            _forward(lib, ctx, status)
        except BaseException as exc:  # never let an exception die in a C callback
            _fail(lib, ctx, INTERNAL, f"{OP_NAME} kernel: {exc!r}")
        finally:
            lib.TF_DeleteStatus(status)

    def delete(_kernel: int) -> None:
        return None

    return [_SHAPE(shape), _CREATE(create), _COMPUTE(compute), _DELETE(delete)]


def _forward(lib: ctypes.CDLL, ctx: int, status: int) -> None:
    """The kernel: fail with the stored error of input 0's token, else pass inputs 1.. through as outputs."""
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
    error = _take_error(token) if token else None
    if token and error is None:
        error = (INTERNAL, f"{OP_NAME}: no error stored under token {token} (was the step run twice?)")
    if error is not None:
        _fail(lib, ctx, *error)
        return
    for i in range(1, lib.TF_NumInputs(ctx)):
        tensor = _VOIDP()
        lib.TF_GetInput(ctx, i, ctypes.byref(tensor), status)
        if lib.TF_GetCode(status) == 0:
            lib.TF_SetOutput(ctx, i - 1, tensor, status)
            lib.TF_DeleteTensor(tensor)
        if lib.TF_GetCode(status) != 0:
            lib.TF_OpKernelContext_Failure(ctx, status)
            return


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if lib.TF_GetCode(status) != 0:
        raise RuntimeError(f"{what}: {lib.TF_Message(status).decode(errors='replace')}")


def _register() -> None:
    lib = _load()
    shape, create, compute, delete = callbacks = _make_callbacks(lib)
    _state["callbacks"] = callbacks  # TensorFlow keeps the function pointers for the life of the process
    _state["lib"] = lib
    status = lib.TF_NewStatus()
    try:
        builder = lib.TF_NewOpDefinitionBuilder(OP_NAME.encode())
        lib.TF_OpDefinitionBuilderAddAttr(builder, b"T: list(type) >= 0")
        lib.TF_OpDefinitionBuilderAddInput(builder, b"token: int64")
        lib.TF_OpDefinitionBuilderAddInput(builder, b"values: T")
        lib.TF_OpDefinitionBuilderAddOutput(builder, b"outputs: T")
        lib.TF_OpDefinitionBuilderSetIsStateful(builder, True)
        lib.TF_OpDefinitionBuilderSetShapeInferenceFunction(builder, shape)
        lib.TF_RegisterOpDefinition(builder, status)  # frees the builder
        _check(lib, status, f"registering op {OP_NAME}")
        kernel = lib.TF_NewKernelBuilder(OP_NAME.encode(), b"CPU", create, compute, delete)
        lib.TF_RegisterKernelBuilder(f"{OP_NAME}Cpu".encode(), kernel, status)  # takes the builder
        _check(lib, status, f"registering the CPU kernel of {OP_NAME}")
    finally:
        lib.TF_DeleteStatus(status)
    tf.no_gradient(OP_NAME)  # callers attach their own gradients (custom_gradient) around it


def available() -> bool:
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


def check_status(token: tf.Tensor, values: Sequence[tf.Tensor], name: Optional[str] = None) -> List[tf.Tensor]:
    """In the current graph: ``values`` unchanged once ``token`` (int64 scalar) is 0; else fail the step."""
    from tensorflow.python.framework import op_def_library
    _, _, _, outputs = op_def_library._apply_op_helper(OP_NAME, name=name, token=token, values=list(values))
    return list(outputs)


def numpy_function(body: Callable[..., List[np.ndarray]], inputs: Sequence[tf.Tensor],
                   out_dtypes: Sequence[tf.DType], name: str) -> List[tf.Tensor]:
    """``tf.numpy_function(body, ...)`` (stateful) in the current graph, followed by HvdliteCheckStatus so
    that ``body``'s mismatch and argument errors fail the step as FailedPrecondition / InvalidArgument."""
    if not available():  # PyFunc maps the errors to InvalidArgument (ValueError, TypeError) or Unknown
        outs: Any = tf.numpy_function(body, list(inputs), list(out_dtypes), stateful=True, name=name)
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]
    placeholders = [np.empty(0, np.dtype(d.as_numpy_dtype)) for d in out_dtypes]

    def deferring(*arrays: np.ndarray) -> List[np.ndarray]:
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


def gate(token: tf.Tensor, values: Sequence[tf.Tensor], name: str) -> List[tf.Tensor]:
    """Like :func:`check_status`, but the op sees only the token and one IdentityN, ordered after it, passes
    ``values`` on (sharing their buffers). The op's Python kernel costs about 30 us per tensor it passes
    through (ctypes on TensorFlow's thread), 30 ms a step for ResNet-50's 214 gradients; IdentityN is C++."""
    from tensorflow.python.framework import op_def_library
    op = op_def_library._apply_op_helper(OP_NAME, name=name, token=token, values=[])[2]
    if not values:
        return []
    with tf.control_dependencies([op]):
        return list(tf.identity_n(list(values), name=name + "Pass"))
