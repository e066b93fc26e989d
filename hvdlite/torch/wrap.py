"""hvd.DistributedOptimizer: picks the gradient-averaging optimizer or, for op=hvd.Adasum, the delta scheme,
and wraps the user's optimizer object in it."""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional

import torch

import hvdlite.core as core
from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import check_gradient_options, check_reduction, mixin_class

from .adasum_optimizer import DistributedAdasumOptimizer
from .async_ops import Adasum, Average
from .compression import Compression
from .optimizer import _DistributedOptimizer
from .replicas import check_every


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         check_replicas_every_steps: int = 0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that step() applies gradients averaged (``op``) over ``process_set``.

    Dense gradients are views of flat buckets; a bucket's in-place allreduce starts from a hook as
    soon as backward() has accumulated its last gradient (or, when ``gradient_overlap`` decides against
    overlap, all of them at step()); step() waits for them, then runs the wrapped optimizer's step. The result is an
    instance of a subclass of ``type(optimizer)`` sharing its param_groups, state and hooks; use it
    instead of the original. For gradient clipping call ``synchronize()``, clip, then ``step()``
    inside ``with optimizer.skip_synchronize():``. ``check_replicas_every_steps=N`` (hvdlite only) runs
    ``hvd.check_replicas`` on the parameters and optimizer state after every N-th step().
    """
    core.size()  # raises NotInitializedError (saying to call hvd.init()) before init
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    reduce_op, backward_passes_per_step = check_gradient_options(op, gradient_predivide_factor,
                                                                 backward_passes_per_step)
    adasum = reduce_op is Adasum and process_set.included() and process_set.size() > 1
    if adasum:
        dtypes = {str(p.dtype).replace("torch.", "") for g in optimizer.param_groups for p in g["params"]}
        check_reduction("allreduce", "DistributedOptimizer(op=hvd.Adasum)", Adasum, sorted(dtypes),
                        set_size=process_set.size())
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups=", DeprecationWarning)
        groups = num_groups if groups is None else groups
    mixin: type = _DistributedOptimizer
    if adasum:  # Horovod's delta scheme: local steps, parameter deltas combined with Adasum
        mixin = DistributedAdasumOptimizer
    cls = mixin_class(mixin, type(optimizer))
    opt: _DistributedOptimizer = object.__new__(cls)
    attrs = dict(optimizer.__dict__)
    attrs.pop("step", None)  # an LR scheduler's per-instance step wrapper is bound to the old object
    opt.__dict__.update(attrs)
    opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                   groups, sparse_as_dense, process_set)
    check_every(opt, int(check_replicas_every_steps))
    return opt
