"""DistributedOptimizer: wraps any torch optimizer; gradient allreduces start during backward() or at step()."""
from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from typing import Any, Iterable, Iterator, Optional

import torch

import hvdlite.core as core
from hvdlite.core import ProcessSet, global_process_set, rank
from hvdlite.core.frontend import (check_gradient_options, check_reduction, check_sparse_compression,
                                   gradient_scales, mixin_class, resolve_op, setting)

from .async_ops import Adasum, Average, sparse_allreduce_async
from .bucket_sync import AdasumDeltas, BucketCollective, BucketSync, HookAllreduce
from .comm_hooks import Reduction, compression_hook, decompressed, start_reduction, write_back
from .compression import Compression
from .grad_ready import Readiness, ReadinessOwner
from .replicas import check_every


class _DistributedOptimizer(ReadinessOwner):
    """Mixed in front of the user's optimizer class: dense gradients live in flat buckets (bucket_sync) reduced by
    the bucket collective (``_hook``; Adasum: bucket_sync.AdasumDeltas), sparse ones apart, as in DDP."""

    param_groups: list[dict[str, Any]]  # the user's optimizer's (this class is mixed in front of it)

    # -- set-up -----------------------------------------------------------------------------------
    def _hvd_setup(self, named_parameters: Optional[Iterable], compression: Any, backward_passes_per_step: int,
                   op: Any, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                   process_set: ProcessSet, adasum: bool) -> None:
        self._compression = compression
        self.op = resolve_op(op)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self._parameter_names: dict[torch.Tensor, str] = _check_names(named_parameters, self.param_groups)
        self._sparse: dict[torch.Tensor, Any] = {}  # sparse gradients in flight: a Handle, or a densified Reduction
        self._sparse_dims: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        units = _make_groups(groups, self._all_params())
        #: prescale and postscale of every gradient reduction (gradient_predivide_factor splits Average's division)
        self._scales = gradient_scales(self.op, self.gradient_predivide_factor)
        self._adasum = adasum  # Horovod's delta scheme: local steps, parameter deltas combined with Adasum
        self._hook: BucketCollective = AdasumDeltas(process_set, compression, self._local_step) if adasum else \
            HookAllreduce(process_set, compression_hook(compression, self.op, *self._scales))
        self._buckets = BucketSync(self._hook, process_set, "grads", setting("fusion_threshold_bytes"), flat=not adasum,
                                   unit=None if units is None else lambda p: units.get(id(p), -id(p)))
        self._readiness = Readiness(process_set, backward_passes_per_step, self._on_grad_ready,
                                    self._all_params())
        self._enabled = self._readiness.enabled
        self._refresh()

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _refresh(self) -> None:
        """Name and hook any parameter that is new or newly requires a gradient."""
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                self._parameter_names.setdefault(p, f"allreduce.noname.{i}.{j}")
        self._readiness.watch(self._all_params())

    # -- during backward ----------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor, complete: bool) -> None:
        """A backward pass made ``p``'s gradient: its bucket takes it (and starts when complete); a sparse one
        is reduced apart once complete."""
        if not self._buckets.take(p, complete, self.overlap) and complete and self.overlap \
                and id(p) in self._buckets.sparse and p not in self._sparse:
            self._sparse[p] = self._start_sparse(p)

    def _start_sparse(self, p: torch.Tensor) -> Any:
        """Reduce ``p``'s sparse gradient (empty if it has none this step: peers may have one), densified
        with sparse_as_dense."""
        name = self._parameter_names[p]
        if p.grad is None:
            sd = self._sparse_dims.get(p, 1)
            p.grad = torch.sparse_coo_tensor(torch.empty((sd, 0), dtype=torch.int64, device=p.device),
                                             torch.empty((0,) + tuple(p.shape[sd:]), dtype=p.dtype,
                                                         device=p.device), p.shape)
        if not p.grad.is_sparse or self.sparse_as_dense:
            if p.grad.is_sparse:
                self._sparse_dims[p] = p.grad.sparse_dim()
            return start_reduction([p.grad.to_dense()], self._compression, name, self.op, *self._scales,
                                   self.process_set)
        self._sparse_dims[p] = p.grad.sparse_dim()
        check_sparse_compression(self._compression, f"the gradient of {name!r}", rank())
        return sparse_allreduce_async(p.grad, name, self.op, self.process_set)

    def _finish_sparse(self, p: torch.Tensor, entry: Any) -> None:
        result = entry.wait()
        if not isinstance(entry, Reduction):
            p.grad = result
            return
        (dense,) = decompressed(entry)
        if p.grad.is_sparse:
            p.grad = dense.to_sparse(self._sparse_dims.get(p, 1)).coalesce()
        else:
            write_back(p.grad, dense)

    # -- public API ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step (starting those not started yet); with Adasum nothing
        (Horovod's Adasum optimizer: step() steps and combines)."""
        if self._enabled and not self._adasum:
            self._reduce()
        self._synchronized = True

    def _reduce(self) -> None:
        """Start what backward has not started (planning the buckets first, re-planning changed ones) and
        finish every reduction of this step."""
        params = self._all_params()
        signature = tuple((id(p), p.requires_grad, p.dtype, p.device, p.numel()) for p in params)
        if signature != self._buckets.signature:  # (only then can a parameter be new or newly trainable)
            self._refresh()
        if not self._buckets.agreed:
            self._buckets.agree(params)  # the first step: one collective fixes the layout
            self._buckets.plan(params, signature)
        self._buckets.refit(params, signature)
        self._buckets.submit_waiting(self.overlap)
        for p in params if self._buckets.sparse else ():
            if id(p) in self._buckets.sparse and p.requires_grad and p not in self._sparse:
                self._sparse[p] = self._start_sparse(p)
        try:
            self._buckets.finish()
            with torch.no_grad():
                for p, entry in self._sparse.items():
                    self._finish_sparse(p, entry)
        finally:
            self._sparse.clear()
            self._readiness.reset()
        if signature != self._buckets.signature:
            self._buckets.plan(params, signature)  # frozen, unfrozen, new, moved: the whole layout afresh

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block step() does not synchronize (call synchronize() yourself first)."""
        if self._adasum:
            raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer: step() "
                                 "applies the local step and combines the deltas in one go")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize unless skip_synchronize() says not to, then the wrapped step; with Adasum: step every bucket
        not stepped yet, combine all deltas and set each parameter to its start plus the combined delta."""
        if self._adasum:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._reduce()
            return loss
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    setattr(step, "hooked", True)  # torch's step hooks run once, in the wrapped step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the wrapped optimizer's; refused while this step's reductions are pending. The buckets stay
        allocated (set_to_none only unsets ``.grad``); the next backward moves the gradients back in."""
        self._readiness.check_zero_grad()
        return super().zero_grad(set_to_none)  # type: ignore[misc]

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket) -> future`` (hvdlite.torch.comm_hooks;
        DDP's protocol); once, before the first backward. Sparse gradients keep their own path."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable as hook(state, bucket), got {hook!r}")
        if getattr(self, "_user_hook", False):
            raise RuntimeError("register_comm_hook() may be called only once per optimizer")
        if self._compression is not Compression.none or self.op != Average or self.gradient_predivide_factor != 1:
            raise ValueError("register_comm_hook: the hook defines the reduction; build the DistributedOptimizer "
                             "without compression=, op= and gradient_predivide_factor= (found "
                             f"compression={getattr(self._compression, '__name__', self._compression)}, "
                             f"op={self.op}, gradient_predivide_factor={self.gradient_predivide_factor})")
        if not isinstance(self._hook, HookAllreduce):  # (Adasum)
            raise ValueError("register_comm_hook: comm hooks reduce gradient buckets by allreduce; they cannot "
                             "be combined with op=hvd.Adasum")
        if self._buckets.agreed or self._readiness.waiting:
            raise RuntimeError("register_comm_hook() must be called before the first backward pass")
        self._hook.hook, self._hook.state, self._user_hook = hook, state, True

    def _local_step(self, params: list[torch.Tensor]) -> None:
        """Adasum: the wrapped optimizer's step on ``params`` only (the others' groups are emptied meanwhile)."""
        wanted = {id(q) for q in params}
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if id(q) in wanted]
            super().step()  # type: ignore[misc]  # the user's optimizer
        finally:
            for group, kept in zip(self.param_groups, stashed):
                group["params"] = kept

    def load_state_dict(self, state_dict: dict) -> None:
        for entry in self._sparse.values():  # never leave a collective unwaited
            entry.wait()
        self._sparse.clear()
        self._buckets.finish(use=False)
        self._synchronized = False
        self._should_synchronize = True
        self._readiness.reset()
        super().load_state_dict(state_dict)  # type: ignore[misc]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         check_replicas_every_steps: int = 0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that step() applies gradients averaged (``op``) over ``process_set``: an instance of
    a subclass of ``type(optimizer)`` sharing its param_groups, state and hooks (docs/torch.md)."""
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
    cls = mixin_class(_DistributedOptimizer, type(optimizer))
    opt: _DistributedOptimizer = object.__new__(cls)
    attrs = dict(optimizer.__dict__)
    attrs.pop("step", None)  # an LR scheduler's per-instance step wrapper is bound to the old object
    opt.__dict__.update(attrs)
    opt._hvd_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                   groups, sparse_as_dense, process_set, adasum)
    check_every(opt, int(check_replicas_every_steps))
    return opt


def _check_names(named_parameters: Optional[Iterable], param_groups: list[dict]) -> dict[torch.Tensor, str]:
    if named_parameters is None:
        return {}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    dups = sorted(name for name, count in Counter(name for name, _ in named).items() if count > 1)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(dups)}")
    names = {id(p): name for name, p in named}
    unnamed = [f"group {i} index {j} (shape {tuple(p.shape)})" for i, g in enumerate(param_groups)
               for j, p in enumerate(g["params"]) if id(p) not in names]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were not named: "
                         f"{'; '.join(unnamed)}. Pass model.named_parameters() of the model the optimizer "
                         f"was built for.")
    return {p: name for name, p in named}


def _make_groups(groups: Any, params: list[torch.Tensor]) -> Optional[dict[int, int]]:
    """``groups=``: id(parameter) -> its unit (reduced together, Horovod's grouped allreduce), or None."""
    if groups is None or groups == 0:
        return None
    if isinstance(groups, int) and groups > 0:  # as even as can be, the first ones one larger
        base, extra = divmod(len(params), groups)
        return {id(p): k for k in range(groups)
                for p in params[k * base + min(k, extra):(k + 1) * base + min(k + 1, extra)]}
    units: dict[int, int] = {}
    if not isinstance(groups, (list, tuple)):
        raise ValueError("groups should be a non-negative integer or a list of lists of torch.Tensor.")
    for k, group in enumerate(groups):
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in units:
                raise ValueError("A parameter can only appear once in groups.")
            units[id(p)] = k
    return units
