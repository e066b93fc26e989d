"""Tiny assertion helpers for MPI worker scripts (each failure names the rank)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


def same(actual: Any, expected: Any, what: str, rank: int) -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape or a.dtype != e.dtype or not np.array_equal(a, e):
        raise AssertionError(f"rank {rank}: {what}: got {a!r} ({a.dtype}, {a.shape}), "
                             f"expected {e!r} ({e.dtype}, {e.shape})")


def raises(kind: type, fn: Callable[[], Any], contains: str = "") -> str:
    try:
        fn()
    except kind as exc:
        text = str(exc)
        if contains not in text:
            raise AssertionError(f"error {text!r} does not contain {contains!r}") from exc
        return text
    raise AssertionError(f"expected {kind.__name__} containing {contains!r}")
