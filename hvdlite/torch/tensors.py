"""Moving torch tensors to the numpy arrays the core works on, and back: zero-copy on CPU where possible."""
from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from hvdlite.core.frontend import (PlaneBuffer, generation, logger, plane_agreed, plane_lacking, setting,
                                   tensor_layout)

from . import mpi_plane
from .plane import FACTORY, PLANE_DTYPES, TORCH_DTYPES

#: A test switch: CPU tensors take the host-staging path of device tensors, so that it runs without a GPU (set it
#: before hvd.init(): what a tensor takes is remembered per job).
STAGE_HOST_COPIES = False

#: torch dtypes the collectives accept (bfloat16 travels as its 16 raw bits): the planes' and this torch's uints.
SUPPORTED_DTYPES = tuple(TORCH_DTYPES.values()) + tuple(getattr(torch, f"uint{n}") for n in (16, 32, 64)
                                                        if hasattr(torch, f"uint{n}"))


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


def check_tensors(tensors: Any, what: str) -> list[torch.Tensor]:
    """A grouped op's ``tensors`` as a list, each checked (check_dtype); ``what``: the op the user called."""
    if isinstance(tensors, (torch.Tensor, str, bytes)) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"{what}: expected a list of torch.Tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for tensor in tensors:
        check_dtype(tensor, what)
    return tensors


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with a CPU tensor (bfloat16 seen as int16 bits) that keeps the tensor alive.
    Not ``Tensor.numpy()``, which makes the storage unresizable for good; the layout is remembered per tensor."""
    entry = _ENTRIES.get(id(tensor))
    if entry is None or not entry.describes(tensor):
        t = tensor.detach()
        if t.is_neg() or t.is_conj() or t.numel() == 0:
            return np.from_dlpack(t.resolve_neg().resolve_conj())
        entry = _remember(tensor)
    holder = _Interface()
    holder.__array_interface__ = entry.interface
    holder.tensor = tensor
    return np.asarray(holder)


class _Interface:
    """What np.asarray views: it carries the layout and holds the tensor whose memory the array uses."""

    __slots__ = ("__array_interface__", "tensor")
    __array_interface__: dict
    tensor: torch.Tensor


class _Entry(NamedTuple):
    """What is remembered about one tensor, for both to_host's view (the layout) and the small-op path
    (prepared(), valid within one generation). Plain data: an entry never keeps its tensor alive; it goes when
    the tensor dies, and is rebuilt when the tensor's memory, layout or dtype changed (a .data swap, resize_,
    set_, as_strided_)."""

    ref: Any  # a weak reference to the tensor
    address: int
    shape: Any
    stride: Any
    dtype: Any
    interface: dict  # the __array_interface__ of its numpy view
    generation: int  # the job prepared() made ``host`` in (-1: not made)
    host: Any  # prepared()'s answer, or None

    def describes(self, tensor: torch.Tensor) -> bool:
        """Whether this entry is still ``tensor``'s: the same tensor, memory, shape, strides and dtype."""
        return self.ref() is tensor and self.address == tensor.data_ptr() and self.shape == tensor.shape \
            and self.stride == tensor.stride() and self.dtype is tensor.dtype


#: id(tensor) -> its entry.
_ENTRIES: dict[int, _Entry] = {}


def _remember(tensor: torch.Tensor) -> _Entry:
    """A new entry for ``tensor`` (its layout), kept."""
    dtype = np.dtype(np.int16) if tensor.dtype == torch.bfloat16 else _NUMPY_DTYPES[tensor.dtype]
    interface = {
        "data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape), "typestr": dtype.str,
        "strides": None if tensor.is_contiguous() else tuple(s * dtype.itemsize for s in tensor.stride()),
        "version": 3}
    key = id(tensor)
    entry = _Entry(weakref.ref(tensor, lambda dead: _forget(key, dead)), tensor.data_ptr(), tensor.shape,
                   tensor.stride(), tensor.dtype, interface, -1, None)
    _ENTRIES[key] = entry
    return entry


def _forget(key: int, dead: Any) -> None:
    entry = _ENTRIES.get(key)
    if entry is not None and entry.ref is dead:
        del _ENTRIES[key]


_NUMPY_DTYPES = {d: np.dtype(str(d).replace("torch.", "")) for d in SUPPORTED_DTYPES if d != torch.bfloat16}


def prepared(tensor: torch.Tensor) -> Optional[tuple[Any, Any, Any]]:
    """``(inputs, dtypes, layout)`` for the core's submit_allreduce when hvdlite's MPI path reduces ``tensor``
    in its own memory (a contiguous CPU tensor, not staged, on no data plane), else None (to_host's path).
    Remembered in the tensor's entry per job (generation) and rebuilt when its memory, layout or dtype changed:
    a gradient reduced every step costs a lookup and no new object. The view does not hold the tensor: the
    caller's handle must (submit_allreduce's ``value`` or ``held``)."""
    entry = _ENTRIES.get(id(tensor))
    if entry is not None and entry.generation == generation() and entry.describes(tensor):
        return entry.host
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in SUPPORTED_DTYPES or tensor.layout != torch.strided \
            or not tensor.is_cpu or STAGE_HOST_COPIES or plane_for(tensor, "allreduce") \
            or not tensor.is_contiguous() or tensor.is_neg() or tensor.is_conj() or tensor.numel() == 0:
        return None
    entry = _remember(tensor)
    holder = _Interface()  # (its tensor slot left empty: the view does not hold the tensor)
    holder.__array_interface__ = entry.interface
    array = np.asarray(holder)
    name = "bfloat16" if tensor.dtype == torch.bfloat16 else array.dtype.name
    host = ((array.view(np.uint16) if name == "bfloat16" else array,), (name,),
            tensor_layout(name, tuple(tensor.shape)))
    _ENTRIES[id(tensor)] = entry._replace(generation=generation(), host=host)
    return host


def plane_for(tensor: torch.Tensor, what: str) -> str:
    """The data plane for ``tensor`` in the op labelled ``what`` ("grouped_allreduce_": an allreduce; "" =
    hvdlite's MPI path: host memory, or host staging for GPU tensors). Decided only from agreed things: the
    job's settings and planes (agreed at init()), the tensor's dtype and its device kind (both in the request's
    signature, so ranks that would choose differently get a mismatch error, never a hang)."""
    kind = what.replace("grouped_", "").rstrip("_")
    if "sparse" in kind or kind == "adasum" or not isinstance(tensor, torch.Tensor):
        return ""
    dtype = str(tensor.dtype).replace("torch.", "")
    if tensor.is_cpu:
        if plane_agreed("gloo") and setting("cpu_operations") == "gloo" and dtype in PLANE_DTYPES:
            return "gloo"
        return ""
    if tensor.device.type != "cuda":
        return ""
    plane = gpu_plane(kind, dtype, str(tensor.device))
    if plane == "nccl":
        own = torch.cuda.current_device()
        if tensor.device.index != own:
            raise RuntimeError(
                f"{kind}: the tensor is on {tensor.device}, but this rank's GPU is cuda:{own} (the current device); "
                f"NCCL runs each rank on its own GPU. Call torch.cuda.set_device(hvd.local_rank()) before building "
                f"the model, and keep the tensors on that device")
    return plane


def gpu_plane(kind: str, dtype: str, device: str = "cuda") -> str:
    """The data plane of a CUDA tensor of ``dtype`` in collective ``kind``: gpu_operations' choice where the job
    has it, else CUDA-aware MPI where every rank has it, else "" (host
    staging through MPI, with one debug line saying why). NCCL asked for by name and missing is an error."""
    choice = setting("gpu_operations")
    if choice == "gloo":
        return "gloo" if kind in ("allreduce", "broadcast") and plane_agreed("gloo") else ""
    if choice != "mpi":
        if plane_agreed("nccl") and dtype in PLANE_DTYPES:
            return "nccl"
        if not plane_agreed("nccl") and choice == "nccl":
            raise RuntimeError(
                f"{kind} of a {device} tensor: HOROVOD_GPU_OPERATIONS asks for "
                f"NCCL, but NCCL is not available on every rank (torch.distributed.is_nccl_available() and "
                f"torch.cuda.is_available() must hold everywhere). Unset it (NCCL where available, else "
                f"CUDA-aware MPI, else host staging), set it to MPI (CUDA-aware MPI where every rank's MPI "
                f"library takes CUDA buffers, else host staging), or install a CUDA build of torch with NCCL")
    if not plane_agreed(mpi_plane.NAME):
        _staging(kind, mpi_cuda_missing())
        return ""
    reduces = kind in ("allreduce", "reducescatter")
    if dtype not in (mpi_plane.REDUCE_DTYPES if reduces else mpi_plane.MOVE_DTYPES):
        _staging(kind, f"MPI {'reduces' if reduces else 'moves'} no {dtype} in device memory")
        return ""
    return mpi_plane.NAME


def mpi_cuda_missing() -> str:
    """Why the job has no CUDA-aware MPI plane: this rank's MPI, or the ranks whose MPI lacks it."""
    mine = FACTORY.mpi_cuda
    if mine is None:
        return "hvdlite is not initialized"
    if not mine[0]:
        return f"this rank's MPI is not CUDA-aware ({mine[1]})"
    if not FACTORY.mpi_cuda_offered:
        return (f"this rank's MPI is CUDA-aware ({mine[1]}), but this rank has no usable CUDA device or no GPU "
                f"setting allows MPI")
    lacking = plane_lacking(mpi_plane.NAME)
    return (f"this rank's MPI is CUDA-aware ({mine[1]}), but that of rank(s) {lacking} is not (or they have no "
            f"CUDA device), and every rank must take the same path")


_LOGGED: set[tuple[str, str]] = set()


def _staging(kind: str, why: str) -> None:
    if (kind, why) not in _LOGGED:
        _LOGGED.add((kind, why))
        logger.debug("CUDA tensors of %s go through host staging: %s", kind, why)


def check_one_device(tensors: Sequence[torch.Tensor], what: str) -> None:
    """A grouped op's tensors share one device (one data plane moves a batch)."""
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(f"{what}: the tensors of one grouped op must be on one device, got "
                         f"{sorted(str(d) for d in devices)}; move them to one device (e.g. "
                         f"t.to(f'cuda:{{hvd.local_rank()}}')) or make one grouped op per device")


def to_host(tensor: torch.Tensor, what: str) -> tuple[Any, bool]:
    """What the core gets for ``tensor``, and whether that shares the tensor's memory: for a data plane
    (plane_for) the tensor itself (contiguous) with a CUDA event on its stream; a CPU tensor's numpy view; else
    (CUDA) a host copy."""
    check_dtype(tensor, what)
    plane = plane_for(tensor, what)
    if plane:
        t = tensor.detach()
        shared = t.is_contiguous()
        if not shared:
            t = t.contiguous()
        ready = torch.cuda.current_stream(t.device).record_event() if t.is_cuda else None
        return PlaneBuffer(plane, t, str(t.dtype).replace("torch.", ""), tuple(t.shape), ready), shared
    if tensor.is_cpu and not STAGE_HOST_COPIES:
        return _numpy_view(tensor), True
    staged = tensor.detach().to("cpu", copy=True).contiguous()
    return _numpy_view(staged), False


def from_host(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s dtype and device holding ``array`` (no copy on CPU); a data plane's result
    already is one."""
    if isinstance(array, torch.Tensor):
        return array
    if not array.flags.writeable:
        array = array.copy()
    if like.dtype == torch.bfloat16:
        out = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(array)
        if out.dtype != like.dtype:
            out = out.to(like.dtype)
    if not like.is_cpu or STAGE_HOST_COPIES:  # staged: back to the device
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
    """The core's dtype hints ("bfloat16" for bf16, whose bits travel as int16)."""
    return ["bfloat16" if t.dtype == torch.bfloat16 else None for t in tensors]
