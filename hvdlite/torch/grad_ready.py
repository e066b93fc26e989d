"""Gradient readiness, shared by DistributedOptimizer and ZeroRedundancyOptimizer: backward hooks, pass counting,
no_sync(), the race guards and the overlap verdict (where buckets and comm hooks plug in)."""
from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from hvdlite.core import ProcessSet
from hvdlite.core.frontend import check_gradient_options, gradient_overlap

if TYPE_CHECKING:
    from .bucket_sync import BucketSync

__all__ = ["Readiness", "ReadinessOwner", "TOO_MANY_PASSES", "ZERO_GRAD_RACE", "ZERO_GRAD_RACE_ZERO"]

TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                  "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
#: ZeroRedundancyOptimizer's wording: it has no synchronize(); step() completes the reductions.
ZERO_GRAD_RACE_ZERO = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step(). "
                       "This is prohibited as it can cause a race condition: call step() first.")

#: id(parameter) -> the Readiness whose hook handles its gradient (the newest built over it): a newer
#: optimizer over the same parameters silences the hooks of older ones.
_owners: dict[int, "weakref.ref[Readiness]"] = {}


class Readiness:
    """Tracks when each parameter's gradient is complete for this step: ``on_ready(p, complete)`` after every
    backward pass, ``complete`` on the one that finishes ``backward_passes_per_step`` (never inside no_sync())."""

    def __init__(self, process_set: ProcessSet, passes: int, on_ready: Callable[[torch.Tensor, bool], None],
                 params: Iterable[torch.Tensor]) -> None:
        self.passes = check_passes(passes)
        self.enabled = process_set.included() and process_set.size() > 1
        self._on_ready = on_ready
        self._delay: dict[int, int] = {}
        self._hooked: set[int] = set()
        self.waiting = False  # counted passes produced gradients that the optimizer has not reduced yet
        self.local = False  # inside no_sync()
        params = list(params)
        on_cpu = all(p.device.type == "cpu" for p in params)
        #: Start reductions from backward (overlap), or all at synchronize; decided once for the process set
        #: (an uneven job must not mix modes: different collectives).
        self.overlap = gradient_overlap(torch.get_num_threads() if on_cpu else None, process_set) \
            if self.enabled else False

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """Hook every parameter of ``params`` that requires a gradient and is not hooked yet."""
        me = weakref.ref(self)
        def hook(param: torch.Tensor) -> None:  # (holds no reference to this Readiness)
            ready, owner = me(), _owners.get(id(param))
            if ready is not None and owner is not None and owner() is ready:
                ready._fire(param)
        for p in params:
            self._delay.setdefault(id(p), self.passes)
            if not p.requires_grad or id(p) in self._hooked or not self.enabled:
                continue
            p.register_post_accumulate_grad_hook(hook)
            self._hooked.add(id(p))
            _owners[id(p)] = me

    def _fire(self, p: torch.Tensor) -> None:
        left = self._delay.get(id(p))
        if left is None:
            return
        if self.local:
            self._on_ready(p, False)
            return
        if left <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._delay[id(p)] = left - 1
        self.waiting = True
        self._on_ready(p, left == 1)

    def reset(self) -> None:
        """A step's reductions are done: count passes afresh."""
        self.waiting = False
        for key in self._delay:
            self._delay[key] = self.passes

    def set_passes(self, passes: int) -> None:
        passes = check_passes(passes)
        if passes > 1 and self.local:
            raise ValueError(_MIXED)
        self.passes = passes
        self.reset()

    def check_zero_grad(self, message: str = ZERO_GRAD_RACE) -> None:
        if self.waiting:
            raise AssertionError(message)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.passes > 1:
            raise ValueError(_MIXED)
        if self.waiting:
            raise RuntimeError("no_sync() was entered after a backward pass whose gradients are being reduced; "
                               "call optimizer.step() (or synchronize()) first, or enter no_sync() before that "
                               "backward pass")
        outer = self.local
        self.local = True
        try:
            yield
        finally:
            self.local = outer


class ReadinessOwner:
    """What DistributedOptimizer and ZeroRedundancyOptimizer expose of their Readiness (``self._readiness``)
    and their buckets (``self._buckets``)."""

    _readiness: Readiness
    _buckets: "BucketSync"

    @property
    def overlap(self) -> bool:
        """Start reductions from backward (overlap), or all at step(); see Config.gradient_overlap. Decided
        once for the process set; may be set between steps (the same way on every rank)."""
        return self._readiness.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self._readiness.overlap = bool(value)

    @property
    def gradients_pending(self) -> bool:
        """hvdlite extension: True from a counted backward pass until the step() (or synchronize()) that
        reduces its gradients (always False on one rank, where nothing is reduced)."""
        return self._readiness.waiting

    @property
    def backward_passes_per_step(self) -> int:
        return self._readiness.passes

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Passes are counted afresh, and so are the buckets' complete gradients (reductions already started
        are finished by the next step, as Horovod's handles are)."""
        self._readiness.set_passes(passes)
        self._buckets.recount()

    def no_sync(self) -> Any:
        """Context manager (DDP's idiom): backward passes inside it accumulate gradients locally and submit
        nothing; the first backward after it reduces everything accumulated (backward_passes_per_step=1 only)."""
        return self._readiness.no_sync()


_MIXED = ("no_sync() cannot be combined with backward_passes_per_step > 1: both accumulate gradients locally "
          "and the passes would be counted twice; use one of them (set backward_passes_per_step=1 to use "
          "no_sync())")


def check_passes(passes: int) -> int:
    """``backward_passes_per_step``, checked by the rule every distributed optimizer applies."""
    return check_gradient_options(None, 1.0, passes)[1]
