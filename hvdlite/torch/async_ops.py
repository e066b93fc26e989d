"""horovod.torch's asynchronous and in-place collectives on torch tensors, built on hvdlite.core."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

import hvdlite.core as core
from hvdlite.core import basics
from hvdlite.core.basics import *  # noqa: F403 - the runtime names, listed once in basics.__all__
from hvdlite.core import (Adasum, Average, Handle, ProcessSet, ReduceOp, Sum,  # noqa: F401 - Sum for the others
                          barrier, global_process_set, join)
from hvdlite.core.frontend import (Accumulation, PlaneBuffer, check_sparse, resolve_op, sparse_allgather_async,
                                   submit_allreduce)

from .tensors import (check_dtype, check_one_device, check_tensors, from_host, hints, prepared,
                      splits_array, to_host, write_into)


def _name(kind: str, name: Optional[str]) -> Optional[str]:
    """Horovod names its ops "<kind>.<name>"; unnamed ops get "<kind>.noname.<n>" from the core."""
    return None if name is None else f"{kind}.{name}"


# -- allreduce ----------------------------------------------------------------------------------------
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, *,
                            accumulation: Optional[Accumulation] = None) -> Handle:
    """Start reducing ``tensors`` as one unit; synchronize() returns new reduced tensors. ``accumulation``:
    an accumulating compression's (``accumulation_of(Compression.bf16_fp32acc)``), see hvdlite.core.api."""
    tensors = check_tensors(tensors, "grouped_allreduce_async")
    return _grouped_allreduce(tensors, name, resolve_op(op, average), prescale_factor, postscale_factor,
                              process_set, False, accumulation, "grouped_allreduce")


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set, *,
                             accumulation: Optional[Accumulation] = None) -> Handle:
    """Start reducing ``tensors`` in place; synchronize() returns the same tensors, now reduced."""
    tensors = check_tensors(tensors, "grouped_allreduce_async_")
    return _grouped_allreduce(tensors, name, resolve_op(op, average), prescale_factor, postscale_factor,
                              process_set, True, accumulation, "grouped_allreduce_")


def _grouped_allreduce(tensors: list[torch.Tensor], name: Optional[str], op: ReduceOp, prescale: float,
                       postscale: float, process_set: ProcessSet, inplace: bool,
                       accumulation: Optional[Accumulation], what: str) -> Handle:
    """The core's grouped allreduce of torch tensors (``what``: the op the user called, for errors)."""
    check_one_device(tensors, what)
    label = "adasum" if op is Adasum else what  # Adasum runs on hvdlite's MPI path only (GPU tensors staged)
    hosts, shared = zip(*[to_host(t, label) for t in tensors]) if tensors else ((), ())
    handle = core.grouped_allreduce_async(list(hosts), None, _name("allreduce", name), op, prescale, postscale,
                                          process_set, inplace=inplace, dtype_hints=hints(tensors),
                                          accumulation=accumulation)
    if not inplace:
        return handle.then(lambda results: [from_host(r, t) for r, t in zip(results, tensors)])
    if all(shared):  # the engine wrote the tensors' own memory: nothing to copy back
        return handle.returning(tensors)
    return handle.then(lambda results: [write_into(t, r, own) for t, r, own in zip(tensors, results, shared)])


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` (left unmodified); synchronize() returns the reduced tensor."""
    return _allreduce(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor, process_set, False)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, *,
                     accumulation: Optional[Accumulation] = None) -> Handle:
    """Start reducing ``tensor`` in place; synchronize() returns ``tensor``."""
    return _allreduce(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor, process_set, True,
                      accumulation)


def _allreduce(tensor: torch.Tensor, name: Optional[str], op: ReduceOp, prescale: float, postscale: float,
               process_set: ProcessSet, inplace: bool, accumulation: Optional[Accumulation] = None) -> Handle:
    """allreduce_async(_) with its op resolved, also the entry of the gradient hooks (torch/comm_hooks.py). A
    tensor of the global set that hvdlite reduces in its own memory is read through the view tensors.prepared
    keeps for it (out of place, into a result tensor made here); any other goes through to_host and the
    core's general path. Both end in the core's one submit, which works out what a name needs once."""
    if process_set is global_process_set and accumulation is None:
        host = prepared(tensor)  # (a tensor it knows was checked when first seen: the check is the other path's)
        if host is not None:
            inputs, dtypes, layout = host
            full = None if name is None else f"allreduce.{name}"  # (_name, inline: it is the fast path)
            if inplace:
                return submit_allreduce(full, inputs, dtypes, layout, inputs, op, prescale, postscale, tensor)
            output = np.empty_like(inputs[0])
            result = torch.from_numpy(output)
            if result.dtype != tensor.dtype:  # bfloat16 (its bits travel as uint16)
                result = from_host(output, tensor)
            return submit_allreduce(full, inputs, dtypes, layout, (output,), op, prescale, postscale, result, tensor)
    check_dtype(tensor, "allreduce_async_" if inplace else "allreduce_async")
    return _grouped_allreduce([tensor], name, op, prescale, postscale, process_set, inplace, accumulation,
                              "allreduce_" if inplace else "grouped_allreduce").first()


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    check_dtype(tensor, "allreduce_")
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    tensors = check_tensors(tensors, "grouped_allreduce_")
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# -- sparse -------------------------------------------------------------------------------------------
def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: Any,
                           process_set: ProcessSet = global_process_set) -> Handle:
    """Combine a sparse COO tensor across ranks by gathering every rank's indices and values
    (hvdlite.core.frontend.sparse_allgather_async: the policy both frontends share); call the handle (or pass it
    to synchronize) for the result."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        got = f"a {tensor.layout} tensor" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"sparse_allreduce_async: expected a sparse COO torch.Tensor, got {got}")
    full_name = _name("sparse", name)
    reduce_op = check_sparse(op, full_name)
    sparse = tensor.coalesce()
    indices = sparse.indices().t().contiguous()
    values = sparse.values().contiguous()
    # torch's Average is a true division (integer values give floating-point ones); bfloat16 values travel
    # as float32, whose division matches torch's and whose round trip is exact
    if values.dtype == torch.bfloat16 or (reduce_op is Average and not values.dtype.is_floating_point):
        wire = values.to(torch.float32 if values.dtype == torch.bfloat16 else torch.get_default_dtype())
    else:
        wire = values

    def finish(result: tuple[Any, Any]) -> torch.Tensor:
        all_indices, all_values = result
        gathered = from_host(all_values, wire)
        if values.dtype == torch.bfloat16:
            gathered = gathered.to(torch.bfloat16)
        return torch.sparse_coo_tensor(from_host(all_indices, indices).t(), gathered, sparse.size(),
                                       check_invariants=False).coalesce()
    return sparse_allgather_async(to_host(indices, "sparse_allreduce_async")[0],
                                  to_host(wire, "sparse_allreduce_async")[0], reduce_op, full_name,
                                  process_set).then(finish)


# -- allgather ----------------------------------------------------------------------------------------
def _rows(inputs: list[torch.Tensor], what: str,
          outputs: Optional[Sequence[torch.Tensor]]) -> tuple[list, Optional[list], Callable[[Any], Any]]:
    """A grouped allgather's or reducescatter's host buffers, host arrays for caller-given outputs, and the
    conversion that returns the results: new tensors, or those outputs, filled (on a data plane the results
    are copied into them on their device, after the same check the core makes)."""
    check_one_device(inputs, what)
    hosts = [to_host(t, what)[0] for t in inputs]
    if outputs is None:
        return hosts, None, lambda results: [from_host(r, t) for r, t in zip(results, inputs)]
    outputs = list(outputs)
    if hosts and isinstance(hosts[0], PlaneBuffer):  # a data plane's: results come back as device tensors
        if len(outputs) != len(inputs) or any(o.dtype != t.dtype for o, t in zip(outputs, inputs)):
            raise TypeError(f"{what}: outputs must be one array per input with the input's dtype; got "
                            f"{[str(o.dtype) for o in outputs]} for inputs {[str(t.dtype) for t in inputs]}")
        return hosts, None, lambda results: [t.copy_(r.reshape(t.shape)) for t, r in zip(outputs, results)]
    into, shared = zip(*[to_host(t, what) for t in outputs]) if outputs else ((), ())
    return hosts, list(into), lambda results: [write_into(t, r, own) for t, r, own in zip(outputs, results, shared)]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set, *,
                            outputs: Optional[Sequence[torch.Tensor]] = None) -> Handle:
    """Start concatenating each tensor's rows from every rank (first dimensions may differ). hvdlite
    extension: ``outputs`` (one tensor of the gathered shape per input, which may hold the input as its
    own rows) receive the results without new allocations; synchronize() returns them."""
    tensors = check_tensors(tensors, "grouped_allgather_async")
    hosts, into, convert = _rows(tensors, "grouped_allgather", outputs)
    handle = core.grouped_allgather_async(hosts, _name("allgather", name), process_set,
                                          dtype_hints=hints(tensors), outputs=into)
    return handle.then(convert)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    check_dtype(tensor, "allgather_async")
    return grouped_allgather_async([tensor], name, process_set).first()


# -- broadcast ----------------------------------------------------------------------------------------
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start copying ``tensor`` from ``root_rank``; synchronize() returns a new tensor."""
    check_dtype(tensor, "broadcast_async")
    host, _ = to_host(tensor, "broadcast")
    handle = core.broadcast_async(host, root_rank, _name("broadcast", name), process_set,
                                  dtype_hint=hints([tensor])[0])
    return handle.then(lambda result: from_host(result, tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start overwriting ``tensor`` with root_rank's value; synchronize() returns ``tensor``."""
    check_dtype(tensor, "broadcast_async_")
    host, shared = to_host(tensor, "broadcast_")
    handle = core.broadcast_async(host, root_rank, _name("broadcast", name), process_set, inplace=True,
                                  dtype_hint=hints([tensor])[0])
    return handle.then(lambda result: write_into(tensor, result, shared))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    check_dtype(tensor, "broadcast_")
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall and reducescatter -----------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Send ``splits[i]`` rows to rank i; synchronize() returns (received tensor, received splits)."""
    check_dtype(tensor, "alltoall_async")
    host, _ = to_host(tensor, "alltoall")
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    handle = core.alltoall_async(host, splits_array(splits), _name("alltoall", name), process_set,
                                 dtype_hint=hints([tensor])[0])
    def received(result: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, counts = result
        return from_host(rows, tensor), torch.from_numpy(np.asarray(counts)).to(split_dtype)
    return handle.then(received)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                                outputs: Optional[Sequence[torch.Tensor]] = None) -> Handle:
    """Start reducing each tensor and keeping this rank's share of its first dimension. hvdlite extension:
    ``outputs`` (one tensor of this rank's share per input, apart from the inputs) receive the results."""
    tensors = check_tensors(tensors, "grouped_reducescatter_async")
    reduce_op = resolve_op(op)
    hosts, into, convert = _rows(tensors, "grouped_reducescatter", outputs)
    handle = core.grouped_reducescatter_async(hosts, _name("reducescatter", name), reduce_op, process_set,
                                              prescale_factor, postscale_factor, dtype_hints=hints(tensors),
                                              outputs=into)
    return handle.then(convert)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    check_dtype(tensor, "reducescatter_async")
    return grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                       postscale_factor).first()


# -- handles and synchronisation ----------------------------------------------------------------------
def poll(handle: Any) -> bool:
    """True when the collective behind ``handle`` has finished (synchronize() will not block)."""
    if not hasattr(handle, "done"):
        raise TypeError(f"poll() takes a handle returned by an *_async function, got {type(handle).__name__}")
    return bool(handle.done())


def synchronize(handle: Any) -> Any:
    """Wait for an asynchronous collective and return its output (or raise its error)."""
    if isinstance(handle, Handle):
        return handle.wait()
    if callable(handle):
        return handle()
    raise TypeError(f"synchronize() takes a handle returned by an *_async function, got "
                    f"{type(handle).__name__}")


def handle_average_backwards_compatibility(op: Any, average: Optional[bool]) -> ReduceOp:
    """Horovod's helper: the ReduceOp meant by ``op=`` or the deprecated ``average=``."""
    return resolve_op(op, average)


__all__ = [
    "handle_average_backwards_compatibility", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize",
]
#: horovod.torch.mpi_ops re-exports the runtime (init, rank, size, ..., process sets, errors, reduce ops).
__all__ += basics.__all__
