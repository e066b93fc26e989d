"""DistributedOptimizer(op=hvd.Adasum): Horovod's delta scheme, local optimizer steps combined with Adasum.

Each rank applies the wrapped optimizer's step to its own gradients, from the same starting parameters;
the parameter deltas (new - start) are combined with Adasum across the process set, and every rank sets
its parameters to start + combined delta. The optimizer's state (momentum, Adam moments) stays local to
each rank, built from its own gradients, as in Horovod. Each parameter is its own Adasum vector.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .async_ops import Adasum, synchronize
from .comm_hooks import Reduction, decompressed, start_reduction
from .optimizer import _DistributedOptimizer


class _Delta:
    """One submitted Adasum of some parameters' deltas, with their starting values."""

    def __init__(self, params: list[torch.Tensor], starts: list[torch.Tensor], reduction: Reduction) -> None:
        self.handle, self.params, self.starts, self.reduction = reduction.handle, params, starts, reduction


class DistributedAdasumOptimizer(_DistributedOptimizer):
    """Mixed in front of the user's optimizer class when ``op=hvd.Adasum`` on a set of 2, 4, 8... ranks.

    Hooks, ``backward_passes_per_step``, ``groups``, ``compression``, names and ``gradient_overlap`` work
    as in the averaging optimizer; what is submitted is a local step's delta instead of the gradient.
    As in Horovod, ``synchronize()`` does nothing (step() does the whole exchange) and
    ``skip_synchronize()`` is refused.
    """

    _bucketed = False  # each unit's local step and delta are its own submission

    def _submit_params(self, params: list[torch.Tensor]) -> list[Any]:
        """Step ``params`` locally, then start the Adasum of their deltas (one grouped allreduce)."""
        with torch.no_grad():
            starts = [q.detach().clone() for q in params]
            self._local_step(params)
            deltas = [(q.detach() - s).contiguous() for q, s in zip(params, starts)]
        started = start_reduction(deltas, self._compression, self._parameter_names[params[0]], Adasum, 1.0, 1.0,
                                  self.process_set)
        return [_Delta(params, starts, started)]

    def _local_step(self, params: list[torch.Tensor]) -> None:
        """The wrapped optimizer's step on ``params`` only (the others' groups are emptied meanwhile)."""
        wanted = {id(q) for q in params}
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if id(q) in wanted]
            super(_DistributedOptimizer, self).step()  # type: ignore[misc]  # the user's optimizer
        finally:
            for group, kept in zip(self.param_groups, stashed):
                group["params"] = kept

    def synchronize(self) -> None:
        """Nothing to do before step() (Horovod's Adasum optimizer): step() steps and combines."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer: step() "
                             "applies the local step and combines the deltas in one go")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        """Step every parameter whose delta has not been submitted yet, combine all deltas with Adasum and
        set each parameter to its starting value plus the combined delta."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refresh()
        self._submit_waiting()  # without overlap: one local step and one grouped submission for all of them
        try:
            with torch.no_grad():
                for entries in self._handles.values():
                    for entry in entries:
                        synchronize(entry.handle)
                        for q, start, delta in zip(entry.params, entry.starts, decompressed(entry.reduction)):
                            q.copy_(start + delta.to(start.dtype))
        finally:
            self._handles.clear()
            self._readiness.reset()
            self._synchronized = False
        return loss

    step.hooked = True  # torch's step hooks run in the wrapped step
