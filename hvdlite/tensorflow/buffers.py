"""Output buffers of one TensorFlow collective op, kept from step to step and reused once TensorFlow is done.

TensorFlow wraps a 64-byte-aligned numpy array without a copy; fresh arrays every step cost page faults on every
byte (ResNet-50's gradients: 1.6x the time on warm buffers). So each op reuses its last output arrays while only
this pool references them, else allocates (also when TensorFlow, from its own threads, lets go a moment late).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np

from hvdlite.core.frontend import aligned_empty


def _references(buf: np.ndarray) -> tuple[int, int]:
    """The reference counts of ``buf`` and of the array owning its memory (0 when it owns it)."""
    base = buf.base
    return sys.getrefcount(buf), (sys.getrefcount(base) if base is not None else 0)


def _baseline() -> tuple[int, int]:
    """The counts of an array only a list references, read as :meth:`ReusableOutputs.like` reads them
    (measured, not assumed: they depend on the interpreter)."""
    held = [aligned_empty((1 << 16,), np.uint8)]  # big enough to sit in a base array, as most outputs do
    buf = held[0]
    return _references(buf)


_UNSHARED = _baseline()


class ReusableOutputs:
    """One op's output arrays, one per input, reused across steps when unshared (see the module doc)."""

    def __init__(self) -> None:
        self._bufs: list[Optional[np.ndarray]] = []

    def like(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Uninitialised aligned arrays shaped like ``arrays`` (this pool's buffers where they are free)."""
        if len(self._bufs) != len(arrays):
            self._bufs = [None] * len(arrays)
        out = []
        for i, a in enumerate(arrays):
            buf = self._bufs[i]  # (as in _baseline: one list slot, one local name)
            if buf is None or buf.shape != a.shape or buf.dtype != a.dtype or \
                    any(n > limit for n, limit in zip(_references(buf), _UNSHARED)):
                buf = aligned_empty(a.shape, a.dtype)
            self._bufs[i] = buf
            out.append(buf)
        return out
