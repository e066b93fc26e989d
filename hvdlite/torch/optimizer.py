"""DistributedOptimizer: wraps any torch optimizer; gradient allreduces start during backward() or at step()."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from hvdlite.core import ProcessSet, rank
from hvdlite.core.frontend import check_sparse_compression, gradient_scales, resolve_op, setting

from .async_ops import Average, sparse_allreduce_async, synchronize
from .bucket_sync import BucketSync, HookAllreduce
from .comm_hooks import Reduction, compression_hook, decompressed, start_reduction, write_back
from .compression import Compression
from .grad_ready import Readiness, ReadinessOwner

Unit = Union[torch.Tensor, tuple]  # one parameter, or a group of parameters reduced together


class _Pending:
    """One submitted reduction of a unit's gradients, with what is needed to put them back."""

    def __init__(self, handle: Any, params: list[torch.Tensor], reduction: Optional[Reduction],
                 densified: list[bool]) -> None:
        self.handle, self.params, self.reduction, self.densified = handle, params, reduction, densified


class _DistributedOptimizer(ReadinessOwner):
    """Mixed in front of the user's optimizer class: ``isinstance(opt, UserOptimizer)`` stays true.

    Dense gradients of parameters outside ``groups=`` live in flat buckets (bucket_sync) reduced through a
    comm hook; sparse gradients, ``groups=`` units and parameters the bucket layout does not cover yet take
    the per-unit path below. Readiness (hooks, pass counting, no_sync, guards) is grad_ready's.
    """

    _bucketed = True  # the Adasum mixin submits local deltas per unit instead

    # -- set-up -----------------------------------------------------------------------------------
    def _hvd_setup(self, named_parameters: Optional[Iterable], compression: Any, backward_passes_per_step: int,
                   op: Any, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                   process_set: ProcessSet) -> None:
        self._compression = compression
        self.op = resolve_op(op)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self._parameter_names: dict[torch.Tensor, str] = _check_names(named_parameters, self.param_groups)
        self._handles: dict[Unit, list[_Pending]] = {}
        self._requires_update: list[torch.Tensor] = []
        self._sparse_dims: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._unit_of: dict[torch.Tensor, Unit] = _make_groups(groups, self.param_groups)
        self._is_grouped = not (groups is None or isinstance(groups, int) and groups == 0)
        self._readiness = Readiness(process_set, backward_passes_per_step, self._on_grad_ready,
                                    self._on_local_grad, self._all_params())
        self._enabled = self._readiness.enabled
        #: prescale and postscale of every gradient reduction (gradient_predivide_factor splits Average's division)
        self._scales = gradient_scales(self.op, self.gradient_predivide_factor)
        self._hook = HookAllreduce(process_set, compression_hook(compression, self.op, *self._scales))
        self._buckets = BucketSync(self._hook, process_set, "grads", setting("fusion_threshold_bytes"),
                                   self._bucket_eligible)
        self._use_buckets = self._bucketed and not self._is_grouped and self._enabled
        self._refresh()

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _bucket_eligible(self, p: torch.Tensor) -> bool:
        return not isinstance(self._unit_of.get(p), tuple) and p.layout == torch.strided

    def _refresh(self) -> None:
        """Name and hook any parameter that is new or newly requires a gradient."""
        self._requires_update = []
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                self._parameter_names.setdefault(p, f"allreduce.noname.{i}.{j}")
                self._unit_of.setdefault(p, (p,) if self._is_grouped else p)
                if p.requires_grad:
                    self._requires_update.append(p)
        self._readiness.watch(self._all_params())

    def _signature(self) -> tuple:
        return tuple((id(p), p.requires_grad, p.dtype, p.device, p.numel()) for p in self._all_params())

    # -- during backward ----------------------------------------------------------------------------
    def _on_local_grad(self, p: torch.Tensor) -> None:
        """A pass inside no_sync(): nothing is submitted; the gradient moves into its bucket once."""
        if self._use_buckets:
            self._buckets.keep(p)

    def _on_grad_ready(self, p: torch.Tensor, complete: bool) -> None:
        """A counted pass made ``p``'s gradient: its bucket takes it (and starts when complete), else its unit
        is submitted once complete."""
        if self._use_buckets and self._buckets.take(p, complete, self.overlap):
            return
        if not complete or not self.overlap:
            return  # without overlap, synchronize() submits them all once backward is done with the CPU
        unit = self._unit_of[p]
        if isinstance(unit, tuple) and not all(self._readiness.complete(q) for q in unit if q.requires_grad):
            return
        if unit not in self._handles:
            self._handles[unit] = self._submit(unit)

    def _submit(self, unit: Unit) -> list[_Pending]:
        params = [q for q in unit if q.requires_grad] if isinstance(unit, tuple) else [unit]
        return self._submit_params(params)

    def _submit_params(self, params: list[torch.Tensor]) -> list[_Pending]:
        """Sparse gradients one by one; every dense one in a single grouped allreduce."""
        pending, dense = [], []
        for q in params:
            self._ensure_grad(q)
            if q.grad.is_sparse:
                self._sparse_dims[q] = q.grad.sparse_dim()
                if not self.sparse_as_dense:
                    check_sparse_compression(self._compression, f"the gradient of {self._parameter_names[q]!r}",
                                             rank())
                    handle = sparse_allreduce_async(q.grad, self._parameter_names[q], self.op, self.process_set)
                    pending.append(_Pending(handle, [q], None, [False]))
                    continue
            dense.append(q)
        if dense:
            densified = [q.grad.is_sparse for q in dense]
            grads = [q.grad.to_dense() if d else q.grad for q, d in zip(dense, densified)]
            started = start_reduction(grads, self._compression, self._parameter_names[dense[0]], self.op,
                                      *self._scales, self.process_set)
            pending.append(_Pending(started.handle, dense, started, densified))
        return pending

    def _ensure_grad(self, p: torch.Tensor) -> None:
        """A parameter without a gradient this step still takes part, with zeros (peers may have one)."""
        if p.grad is not None:
            return
        if p in self._sparse_dims:
            sd = self._sparse_dims[p]
            p.grad = torch.sparse_coo_tensor(torch.empty((sd, 0), dtype=torch.int64, device=p.device),
                                             torch.empty((0,) + tuple(p.shape[sd:]), dtype=p.dtype,
                                                         device=p.device), p.shape)
        else:
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _submit_waiting(self) -> None:
        """Submit every unit whose reduction has not started yet: one by one when overlapping, else in one
        grouped submission (per-tensor requests would cost more than they overlap)."""
        seen: set[int] = set()
        waiting: list[Unit] = []
        for p in self._requires_update:
            if self._use_buckets and self._buckets.covers(p):
                continue
            unit = self._unit_of[p]
            if id(unit) not in seen:
                seen.add(id(unit))
                if unit not in self._handles:
                    waiting.append(unit)
        if self.overlap:
            for unit in waiting:
                self._handles[unit] = self._submit(unit)
        elif waiting:
            params = [q for u in waiting for q in (u if isinstance(u, tuple) else (u,)) if q.requires_grad]
            self._handles[waiting[0]] = self._submit_params(params)

    # -- public API ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step (starting those not started yet)."""
        if not self._enabled:
            self._synchronized = True
            return
        self._refresh()
        signature = self._signature() if self._use_buckets else ()
        if self._use_buckets and not self._buckets.agreed:
            self._buckets.agree(self._all_params())  # the first step: one collective fixes the layout
            self._buckets.plan(self._all_params(), signature)
        if self._use_buckets:
            self._buckets.check(signature)
            self._buckets.submit_waiting(self.overlap)
        self._submit_waiting()
        try:
            self._buckets.finish()
            with torch.no_grad():
                for entries in self._handles.values():
                    for entry in entries:
                        self._finish(entry)
        finally:
            self._handles.clear()
            self._readiness.reset()
        if self._use_buckets and signature != self._buckets.signature:
            self._buckets.plan(self._all_params(), signature)  # frozen, unfrozen, new, moved: re-plan
        self._synchronized = True

    def _finish(self, entry: _Pending) -> None:
        if entry.reduction is None:  # a sparse gradient
            entry.params[0].grad = synchronize(entry.handle)
            return
        synchronize(entry.handle)
        for q, result, densified in zip(entry.params, decompressed(entry.reduction), entry.densified):
            if densified:
                q.grad = result.to_sparse(self._sparse_dims.get(q, 1)).coalesce()
            else:
                write_back(q.grad, result)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block step() does not synchronize (call synchronize() yourself first)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    step.hooked = True  # torch's step hooks run once, in the wrapped step

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
        if not self._bucketed or self._is_grouped:
            raise ValueError("register_comm_hook: comm hooks reduce gradient buckets; they cannot be combined "
                             "with groups= or op=hvd.Adasum")
        if self._buckets.agreed or self._readiness.waiting:
            raise RuntimeError("register_comm_hook() must be called before the first backward pass")
        self._hook.hook, self._hook.state, self._user_hook = hook, state, True

    def load_state_dict(self, state_dict: dict) -> None:
        for entries in self._handles.values():  # never leave a collective unwaited
            for entry in entries:
                synchronize(entry.handle)
        self._handles.clear()
        self._buckets.drain()
        self._synchronized = False
        self._should_synchronize = True
        self._readiness.reset()
        super().load_state_dict(state_dict)  # type: ignore[misc]



def _check_names(named_parameters: Optional[Iterable], param_groups: list[dict]) -> dict[torch.Tensor, str]:
    if named_parameters is None:
        return {}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    seen: set[str] = set()
    dups = sorted({name for name, _ in named if name in seen or seen.add(name)})
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


def _make_groups(groups: Any, param_groups: list[dict]) -> dict[torch.Tensor, Unit]:
    """Map each parameter to its reduction unit: itself, or a tuple reduced with one grouped allreduce."""
    params = [p for g in param_groups for p in g["params"]]
    if groups is None or groups == 0:
        return {p: p for p in params}
    units: list[tuple] = []
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups should be a non-negative integer or a list of lists of torch.Tensor.")
        base, extra = divmod(len(params), groups)
        start = 0
        for k in range(groups):
            n = base + (1 if k < extra else 0)
            if n:
                units.append(tuple(params[start:start + n]))
            start += n
    elif isinstance(groups, (list, tuple)):
        known = {id(p) for p in params}
        placed: set[int] = set()
        for group in groups:
            members = []
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in placed:
                    raise ValueError("A parameter can only appear once in groups.")
                placed.add(id(p))
                if id(p) in known:
                    members.append(p)
            if members:
                units.append(tuple(members))
        units.extend((p,) for p in params if id(p) not in placed)
    else:
        raise ValueError("groups should be a non-negative integer or a list of lists of torch.Tensor.")
    return {p: unit for unit in units for p in unit}
