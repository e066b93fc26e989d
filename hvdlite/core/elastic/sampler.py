"""Which samples of an epoch each rank takes in an elastic job, so a resumed epoch repeats and skips nothing."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import runtime


class ElasticShards:
    """The framework-free part of ``ElasticSampler``: an epoch's permutation (seeded by ``seed + epoch``) less
    the samples processed, padded to a multiple of the world size and dealt out round-robin. ``record_batch(i,
    b)`` marks batch ``i`` of every rank processed (all ranks take batch ``i`` in the same step), so the record
    needs no communication and is the same in every host's commit."""

    elastic_resettable = True

    def __init__(self, num_samples: int, shuffle: bool = True, seed: int = 0) -> None:
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.processed: set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Deal the epoch's unprocessed samples out to the current world (called after every restart)."""
        self.num_replicas, self.rank = runtime.size(), runtime.rank()
        order = np.random.RandomState(self.seed + self.epoch).permutation(self.num_samples).tolist() if self.shuffle \
            else range(self.num_samples)
        remaining: list[int] = [i for i in order if i not in self.processed]
        pad = -len(remaining) % self.num_replicas
        if remaining and pad:
            remaining += (remaining * (pad // len(remaining) + 1))[:pad]
        self._remaining = remaining
        self.indices = remaining[self.rank::self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``; setting the epoch already in progress keeps what it has processed, so a
        loop that calls set_epoch(state.epoch) after a restart resumes mid-epoch."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.processed = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (of ``batch_size`` per rank) of every rank as processed."""
        lo, hi = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for rank in range(self.num_replicas):
            self.processed.update(self._remaining[rank::self.num_replicas][lo:hi])

    def __len__(self) -> int:
        return len(self.indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed": sorted(self.processed), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed = set(state["processed"])
        self.seed = int(state.get("seed", self.seed))
        self.reset()
