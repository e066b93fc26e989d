"""Exact comparison for in-rank tests: same shape, same dtype, same values (numpy arrays or scalars)."""
from __future__ import annotations

from typing import Any

import numpy as np


def same(actual: Any, expected: Any, what: str = "") -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype and np.array_equal(a, e), \
        f"{what}: got {a!r} ({a.dtype}, {a.shape}), expected {e!r} ({e.dtype}, {e.shape})"
