"""DistributedOptimizer: wraps any torch optimizer; gradient allreduces start during backward() or at step()."""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from hvdlite.core import ProcessSet
from hvdlite.core.frontend import gradient_overlap, resolve_op

from .async_ops import Average, grouped_allreduce_async_, sparse_allreduce_async, synchronize

Unit = Union[torch.Tensor, tuple]  # one parameter, or a group of parameters reduced together


class _Pending:
    """One submitted reduction of a unit's gradients, with what is needed to put them back."""

    def __init__(self, handle: Any, params: list[torch.Tensor], wire: list[torch.Tensor], ctxs: list[Any],
                 densified: list[bool], sparse: bool = False) -> None:
        self.handle, self.params, self.wire, self.ctxs = handle, params, wire, ctxs
        self.densified, self.sparse = densified, sparse


class _DistributedOptimizer:
    """Mixed in front of the user's optimizer class: ``isinstance(opt, UserOptimizer)`` stays true."""

    # -- set-up -----------------------------------------------------------------------------------
    def _hvd_setup(self, named_parameters: Optional[Iterable], compression: Any, backward_passes_per_step: int,
                   op: Any, gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                   process_set: ProcessSet) -> None:
        self._compression = compression
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.op = resolve_op(op)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self._parameter_names: dict[torch.Tensor, str] = _check_names(named_parameters, self.param_groups)
        self._allreduce_delay: dict[torch.Tensor, int] = {}
        self._handles: dict[Unit, list[_Pending]] = {}
        self._hooked: set[torch.Tensor] = set()
        self._hook_handles: list[Any] = []
        self._requires_update: list[torch.Tensor] = []
        self._sparse_dims: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._unit_of: dict[torch.Tensor, Unit] = _make_groups(groups, self.param_groups)
        self._is_grouped = not (groups is None or isinstance(groups, int) and groups == 0)
        self._enabled = process_set.included() and process_set.size() > 1
        self._grads_waiting = False  # backward produced gradients that synchronize() has not finished
        on_cpu = all(p.device.type == "cpu" for g in self.param_groups for p in g["params"])
        #: Submit each allreduce from backward (overlap), or all of them at synchronize().
        #: Decided once for the process set (an uneven job must not mix modes: different collectives).
        self.overlap = gradient_overlap(torch.get_num_threads() if on_cpu else None, process_set) \
            if self._enabled else False
        self._refresh()

    def _refresh(self) -> None:
        """Name and hook any parameter that is new or newly requires a gradient."""
        self._requires_update = []
        me = weakref.ref(self)
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                self._parameter_names.setdefault(p, f"allreduce.noname.{i}.{j}")
                self._allreduce_delay.setdefault(p, self.backward_passes_per_step)
                self._unit_of.setdefault(p, (p,) if self._is_grouped else p)
                if not p.requires_grad:
                    continue
                self._requires_update.append(p)
                if self._enabled and p not in self._hooked:
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(_make_hook(me)))
                    self._hooked.add(p)
                    _owners[id(p)] = me  # a newer DistributedOptimizer over p silences older ones' hooks

    # -- during backward ----------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if p not in self._allreduce_delay:
            return
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally.")
        self._allreduce_delay[p] -= 1
        self._grads_waiting = True
        if not self.overlap or self._allreduce_delay[p] > 0:
            return  # without overlap, synchronize() submits them all once backward is done with the CPU
        unit = self._unit_of[p]
        if isinstance(unit, tuple) and not all(self._allreduce_delay[q] == 0 for q in unit if q.requires_grad):
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
                    handle = sparse_allreduce_async(q.grad, self._parameter_names[q], self.op, self.process_set)
                    pending.append(_Pending(handle, [q], [], [], [False], sparse=True))
                    continue
            dense.append(q)
        if dense:
            densified = [q.grad.is_sparse for q in dense]
            grads = [q.grad.to_dense() if d else q.grad for q, d in zip(dense, densified)]
            pairs = [self._compression.compress(g) for g in grads]
            wire = [w for w, _ in pairs]
            pre, post = 1.0, 1.0
            if self.op == Average:
                pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
            handle = grouped_allreduce_async_(wire, name=self._parameter_names[dense[0]], op=self.op,
                                              prescale_factor=pre, postscale_factor=post,
                                              process_set=self.process_set)
            pending.append(_Pending(handle, dense, wire, [c for _, c in pairs], densified))
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
        self._refresh()
        seen: set[int] = set()
        waiting: list[Unit] = []
        for p in self._requires_update:
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
        self._submit_waiting()
        with torch.no_grad():
            for entries in self._handles.values():
                for entry in entries:
                    self._finish(entry)
        self._handles.clear()
        self._grads_waiting = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    def _finish(self, entry: _Pending) -> None:
        if entry.sparse:
            entry.params[0].grad = synchronize(entry.handle)
            return
        synchronize(entry.handle)
        for q, wire, ctx, densified in zip(entry.params, entry.wire, entry.ctxs, entry.densified):
            result = self._compression.decompress(wire, ctx)
            if densified:
                q.grad = result.to_sparse(self._sparse_dims.get(q, 1)).coalesce()
            elif result is not q.grad:
                q.grad.copy_(result)

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

    step.hooked = True  # type: ignore[attr-defined]  # torch's step hooks run once, in the wrapped step

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._grads_waiting:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super().zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = int(passes)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def load_state_dict(self, state_dict: dict) -> None:
        for entries in self._handles.values():  # never leave a collective unwaited
            for entry in entries:
                synchronize(entry.handle)
        self._handles.clear()
        self._grads_waiting = False
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super().load_state_dict(state_dict)  # type: ignore[misc]


#: id(parameter) -> the DistributedOptimizer whose hook reduces its gradient (the last one built over it).
_owners: dict[int, "weakref.ref[_DistributedOptimizer]"] = {}


def _make_hook(me: "weakref.ref[_DistributedOptimizer]") -> Any:
    def hook(param: torch.Tensor) -> None:
        opt, owner = me(), _owners.get(id(param))
        if opt is not None and opt._enabled and owner is not None and owner() is opt:
            opt._on_grad_ready(param)
    return hook


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
