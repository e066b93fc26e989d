"""hvdlite.torch.elastic: Horovod's elastic API for PyTorch (TorchState, ElasticSampler, run) on the core's."""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.utils.data

from hvdlite.core.elastic import ElasticShards, HostsUpdatedInterrupt, ObjectState, State, run

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


class TorchState(ObjectState):
    """The model, the optimizer (restored in place with load_state_dict()) and any other values."""

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any) -> None:
        values = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(**values, **kwargs)


class ElasticSampler(ElasticShards, torch.utils.data.Sampler):
    """Shards a dataset over the current ranks and resumes a restarted epoch where its last commit was
    (``record_batch(batch_idx, batch_size)`` after each batch; keep it in the elastic state)."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        super().__init__(len(dataset), shuffle=shuffle, seed=seed)

    @property
    def processed_indices(self) -> set[int]:
        return self.processed

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))
