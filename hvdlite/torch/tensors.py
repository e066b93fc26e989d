"""Moving torch tensors to the numpy arrays the core works on, and back: zero-copy on CPU where possible."""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hvdlite.core.frontend import stage_host_copies

#: torch dtypes the collectives accept (bfloat16 travels as its 16 raw bits).
SUPPORTED_DTYPES = tuple(d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.bool, getattr(torch, "uint16", None), getattr(torch, "uint32", None),
    getattr(torch, "uint64", None)) if d is not None)


def check_dtype(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what}: tensors of dtype {tensor.dtype} are not supported by hvdlite; "
                        f"supported dtypes: {names}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: {tensor.layout} tensors are not supported here; use a dense tensor "
                        f"(sparse gradients go through hvd.sparse_allreduce_async)")


def dtype_hint(tensor: torch.Tensor) -> Optional[str]:
    """The core's dtype hint for ``tensor`` ("bfloat16" for bf16, whose bits travel as int16)."""
    return "bfloat16" if tensor.dtype == torch.bfloat16 else None


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with a CPU tensor (bfloat16 seen as int16 bits); the array keeps
    the tensor alive, so a collective may outlive every other reference to its input.

    Not ``Tensor.numpy()``: that marks the tensor's storage as not resizable for good, so ``t.resize_()``
    would fail after any collective on ``t``. The view is built from the tensor's address; the layout is
    remembered per tensor (see _LAYOUTS), so a gradient reduced every step costs a lookup.
    """
    entry = _LAYOUTS.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1] != tensor.data_ptr() \
            or entry[2] != tensor.shape or entry[3] != tensor.stride():
        t = tensor.detach()
        if t.is_neg() or t.is_conj() or t.numel() == 0:
            return np.from_dlpack(t.resolve_neg().resolve_conj())
        entry = _remember(tensor)
    holder = _Interface()
    holder.__array_interface__ = entry[4]
    holder.tensor = tensor
    return np.asarray(holder)


class _Interface:
    """What np.asarray views: it carries the layout and holds the tensor whose memory the array uses."""

    __slots__ = ("__array_interface__", "tensor")


#: id(tensor) -> (weak reference, address, shape, strides, __array_interface__ dict). Plain data: an entry
#: never keeps its tensor alive; it goes when the tensor dies, and is rebuilt when the tensor's memory or
#: layout changed (resize_, set_, as_strided_).
_LAYOUTS: dict[int, tuple[Any, int, Any, Any, dict]] = {}


def _remember(tensor: torch.Tensor) -> tuple[Any, int, Any, Any, dict]:
    dtype = np.dtype(np.int16) if tensor.dtype == torch.bfloat16 else _NUMPY_DTYPES[tensor.dtype]
    interface = {
        "data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape), "typestr": dtype.str,
        "strides": None if tensor.is_contiguous() else tuple(s * dtype.itemsize for s in tensor.stride()),
        "version": 3}
    key = id(tensor)
    entry = (weakref.ref(tensor, lambda dead: _forget(key, dead)), tensor.data_ptr(), tensor.shape,
             tensor.stride(), interface)
    _LAYOUTS[key] = entry
    return entry


def _forget(key: int, dead: Any) -> None:
    entry = _LAYOUTS.get(key)
    if entry is not None and entry[0] is dead:
        del _LAYOUTS[key]


_NUMPY_DTYPES = {d: np.dtype(str(d).replace("torch.", "")) for d in SUPPORTED_DTYPES if d != torch.bfloat16}


def _staged(tensor: torch.Tensor) -> bool:
    """Device tensors go through a host copy; CPU ones too under the stage_host_copies setting (tests)."""
    return not tensor.is_cpu or stage_host_copies()


def to_host(tensor: torch.Tensor, what: str) -> tuple[np.ndarray, bool]:
    """A host array for ``tensor`` and whether it shares the tensor's memory.

    CPU tensors are viewed without a copy (the core copies non-contiguous ones itself and writes
    in-place results back through the view). Tensors on any other device (CUDA) are staged through
    a contiguous host copy, taken on the tensor's current stream.
    """
    check_dtype(tensor, what)
    if not _staged(tensor):
        return _numpy_view(tensor), True
    staged = tensor.detach().to("cpu", copy=True).contiguous()
    return _numpy_view(staged), False


def from_host(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype and device holding ``array`` (no copy on CPU)."""
    if not array.flags.writeable:
        array = array.copy()
    if like.dtype == torch.bfloat16:
        out = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(array)
        if out.dtype != like.dtype:
            out = out.to(like.dtype)
    if _staged(like):
        out = out.to(like.device, copy=True)
    return out


def write_into(tensor: torch.Tensor, array: np.ndarray, shared: bool) -> torch.Tensor:
    """Finish an in-place op: copy a staged result back unless the engine already wrote the memory."""
    if not shared:
        with torch.no_grad():
            tensor.copy_(from_host(array, tensor).reshape(tensor.shape))
    return tensor


def splits_array(splits: Any) -> Optional[np.ndarray]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return np.from_dlpack(splits.detach().cpu()).astype(np.int64).reshape(-1)  # .numpy() would pin it
    return np.asarray(list(splits) if not isinstance(splits, np.ndarray) else splits, dtype=np.int64)


def hints(tensors: Sequence[torch.Tensor]) -> list[Optional[str]]:
    return [dtype_hint(t) for t in tensors]
