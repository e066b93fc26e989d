"""DistributedOptimizer(op=hvd.Adasum): Horovod's delta scheme, local optimizer steps combined with Adasum.

Each rank steps from the same parameters with its own gradients (its optimizer state stays local, as in
Horovod); the deltas are combined with Adasum, each parameter its own vector, and added to the start."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .bucket_sync import AdasumDeltas, BucketCollective
from .optimizer import _DistributedOptimizer


class DistributedAdasumOptimizer(_DistributedOptimizer):
    """Mixed in front of the user's optimizer class when ``op=hvd.Adasum`` on a set of 2, 4, 8... ranks: the
    averaging optimizer with bucket_sync.AdasumDeltas as the bucket collective. As in Horovod, ``synchronize()``
    does nothing (step() does the whole exchange) and ``skip_synchronize()`` is refused."""

    def _collective(self) -> BucketCollective:
        return AdasumDeltas(self.process_set, self._compression, self._local_step)

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
        """Step every bucket not stepped yet, combine all deltas with Adasum and set each parameter to its
        starting value plus the combined delta."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce()
        self._synchronized = False
        return loss

    setattr(step, "hooked", True)  # torch's step hooks run in the wrapped step
