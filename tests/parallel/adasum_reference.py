"""Adasum's tree in plain numpy, the reference the in-rank tests compare the engine's and the frontends' with."""
from __future__ import annotations

import numpy as np


def reference(vectors: list[np.ndarray]) -> np.ndarray:
    """``vectors[r]`` is rank r's input: pairs combined level by level (hvdlite/core/engine/adasum.py's formula)."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, anorm, bnorm = float(a @ b), float(a @ a), float(b @ b)
            acoeff = 1.0 - dot / (2 * anorm) if anorm > 0 else 1.0
            bcoeff = 1.0 - dot / (2 * bnorm) if bnorm > 0 else 1.0
            nxt.append(acoeff * a + bcoeff * b)
        level = nxt
    return level[0]
