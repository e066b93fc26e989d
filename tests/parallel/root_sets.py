"""Shared by the root_rank tests (test_root_rank.py, test_tf_root_rank.py): the members of the process set of every
rank but 0 (the ``ps`` fixture of tests/parallel/conftest.py), and a value that differs on every rank."""
from __future__ import annotations

from typing import Any

import numpy as np

import hvdlite as hvd

MEMBERS = list(range(1, hvd.size()))


def value(rank: int, dtype: Any = np.float64) -> np.ndarray:
    return (np.arange(6, dtype=np.float64).reshape(2, 3) * 10 + rank).astype(dtype)
