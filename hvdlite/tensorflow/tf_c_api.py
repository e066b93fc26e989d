"""A ctypes binding of TensorFlow's stable C API (ops.h, kernels.h) for one op whose kernel is a Python
function: load the library, and build the kernel's callback."""
from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional

import tensorflow as tf

__all__ = ["load", "make_kernel", "NO_CREATE", "NO_DELETE", "check", "fail", "INVALID_ARGUMENT",
           "FAILED_PRECONDITION", "INTERNAL"]

#: TF_Code values (tensorflow/c/tf_status.h).
INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
INTERNAL = 13

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
    """The C compute callback of op ``op_name``'s kernel, returned so the caller keeps it alive forever: it
    fails with ``take_error(token)`` for a nonzero token (input 0). The kernel has no create or delete
    callback (NULL: it keeps no state): TensorFlow creates and destroys kernels while it holds its own locks
    (tf.random.set_seed clears every cached kernel under the eager context's lock), and a Python callback
    there needs the GIL, which a thread waiting for that lock may hold (a deadlock)."""

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
