"""Shared by the root_rank tests (test_root_rank.py, test_tf_root_rank.py): the process set of every rank but 0,
and a value that differs on every rank."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

import hvdlite as hvd

MEMBERS = list(range(1, hvd.size()))


@pytest.fixture
def ps() -> Iterator[Any]:
    """The set of every rank but 0, registered for one test."""
    pset = hvd.add_process_set(MEMBERS)
    yield pset
    hvd.remove_process_set(pset)


def value(rank: int, dtype: Any = np.float64) -> np.ndarray:
    return (np.arange(6, dtype=np.float64).reshape(2, 3) * 10 + rank).astype(dtype)
