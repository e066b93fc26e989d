"""Start-of-training helpers: broadcast_parameters, broadcast_optimizer_state (the object helpers are the core's)."""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch

import hvdlite.core as core
from hvdlite.core import ProcessSet, global_process_set

from .async_ops import broadcast_async_, synchronize


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's tensors (``state_dict()``, ``named_parameters()`` or ``parameters()``) in place with
    root_rank's; a dict's non-tensor values are broadcast as objects."""
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, str, bytes)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}; pass model.state_dict(), "
                         f"model.named_parameters() or model.parameters()")
    handles, scalars, seen = [], {}, set()
    for name, value in items:
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.dtype, tuple(value.shape), tuple(value.stride()), value.device)
            if value.numel() and key in seen:  # tied weights: one broadcast per memory region
                continue
            seen.add(key)
            handles.append(broadcast_async_(value, root_rank, None if name is None else str(name), process_set))
        elif isinstance(params, dict):
            scalars[name] = value
        else:
            raise ValueError(f"broadcast_parameters: entry {name!r} is a {type(value).__name__}, not a tensor")
    for handle in handles:
        synchronize(handle)
    if scalars:
        params.update(core.broadcast_object(scalars, root_rank, None, process_set))


class _TensorSpec(NamedTuple):
    """Stands for one optimizer-state tensor in the structure sent ahead of the data."""

    shape: tuple
    dtype: torch.dtype


def _step_with_zero_gradients(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's start for an optimizer without state: a zero gradient for each parameter that requires one (sparse
    for SparseAdam, and for SGD on ``model``'s sparse Embeddings), then one local step (without reductions)."""
    modules = model.modules() if model is not None and isinstance(optimizer, torch.optim.SGD) else ()
    sparse = {id(p) for m in modules if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for p in (p for group in optimizer.param_groups for p in group["params"] if p.requires_grad):
        p.grad = torch.zeros_like(p)
        if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
            p.grad = p.grad.to_sparse()
    getattr(type(optimizer), "_hvd_base", type(optimizer)).step(optimizer)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal root_rank's, stepping a stateless one with zero
    gradients first as Horovod does (docs/torch.md); a ProcessSet passed third is ``process_set``."""
    if isinstance(model, ProcessSet):
        process_set, model = model, None
    if not optimizer.state_dict()["state"] and not isinstance(optimizer, torch.optim.LBFGS):
        _step_with_zero_gradients(optimizer, model)
    state_dict = optimizer.state_dict()
    mine = ({pid: {k: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                   for k, v in entry.items()} for pid, entry in state_dict["state"].items()},
            [{k: v for k, v in group.items() if k != "params"} for group in state_dict["param_groups"]])
    root_state, root_groups = core.broadcast_object(mine, root_rank, None, process_set)
    if len(root_groups) != len(state_dict["param_groups"]):
        raise ValueError(f"broadcast_optimizer_state: rank {core.rank()} has {len(state_dict['param_groups'])} "
                         f"param groups but root rank {root_rank} has {len(root_groups)}; build the same "
                         f"optimizer on every rank")
    new_state: dict[Any, dict] = {}
    tensors: list[tuple[str, torch.Tensor]] = []
    for pid in sorted(root_state, key=str):
        entry = new_state[pid] = dict(root_state[pid])
        for key, value in entry.items():
            if isinstance(value, _TensorSpec):
                tensor = state_dict["state"].get(pid, {}).get(key)
                fits = isinstance(tensor, torch.Tensor) and (tuple(tensor.shape), tensor.dtype) == value
                entry[key] = tensor if fits else torch.empty(value.shape, dtype=value.dtype)
                tensors.append((f"optimizer_state.{pid}.{key}", entry[key]))
    broadcast_parameters(tensors, root_rank, process_set)
    if core.rank() != root_rank:  # a rank of the whole job, as in Horovod
        groups = [dict(root, params=own["params"]) for root, own in zip(root_groups, state_dict["param_groups"])]
        optimizer.load_state_dict({"state": new_state, "param_groups": groups})
