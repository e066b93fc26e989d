"""hvd.check_replicas for torch: a module's parameters and buffers, an optimizer's parameters and state, or
tensors; and DistributedOptimizer's check every N steps."""
from __future__ import annotations

import functools
import itertools
from typing import Any, Optional

import numpy as np
import torch

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_named_replicas, flatten_tensors


def _leaf(value: Any) -> Optional[np.ndarray]:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype is torch.bfloat16:
            t = t.float()  # exact: every bfloat16 is a float32
        return t.cpu().resolve_conj().numpy()
    return None


def check_replicas(obj: Any, process_set: ProcessSet = global_process_set) -> int:
    """hvd.check_replicas of a torch module (its state_dict), an optimizer (each parameter, its state and the
    groups' numeric hyperparameters), or a collection of tensors, numpy arrays and numbers."""
    if isinstance(obj, torch.nn.Module):
        named = flatten_tensors(obj.state_dict(), _leaf)
    elif isinstance(obj, torch.optim.Optimizer):
        names = getattr(obj, "_parameter_names", {})
        named = []
        for g, group in enumerate(obj.param_groups):
            for i, p in enumerate(group["params"]):
                name = names.get(p, f"param_groups[{g}].params[{i}]")
                named += flatten_tensors(p, _leaf, name)
                named += flatten_tensors(dict(obj.state.get(p, {})), _leaf, f"{name} state")
            named += flatten_tensors({k: v for k, v in group.items() if k != "params"}, _leaf,
                                     f"param_groups[{g}]")
    else:
        named = flatten_tensors(obj, _leaf)
    return check_named_replicas(named, process_set)


def check_every(opt: torch.optim.Optimizer, steps: int) -> None:
    """DistributedOptimizer's ``check_replicas_every_steps``: check ``opt`` after every ``steps``-th step()."""
    if steps <= 0:
        return
    step, count = opt.step, itertools.count(1)

    @functools.wraps(step)
    def checked_step(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        if next(count) % steps == 0:
            check_replicas(opt, opt.process_set)
        return result
    opt.step = checked_step


__all__ = ["check_every", "check_replicas"]
