"""Requests (what a rank submitted) and responses (what all ranks agreed to run)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import numpy as np

from .handles import Handle
from .reduce_ops import ReduceOp

#: Kinds whose request a joined rank stands in for (with zeros, no rows, or nothing).
JOIN_TOLERANT = frozenset({"allreduce", "allgather", "broadcast", "barrier"})
#: Kinds remembered by the response cache (agreed with a bit-vector in steady state).
CACHEABLE = frozenset({"allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier"})

# Field positions inside a signature tuple.
SIG_KIND, SIG_PSET, SIG_OP, SIG_PRE, SIG_POST, SIG_ROOT, SIG_TENSORS, SIG_EXTRA = range(8)
SIG_LABELS = ("operation", "process set", "reduce op", "prescale_factor", "postscale_factor",
              "root rank", "tensors", "arguments")

Signature = tuple


def make_signature(kind: str, ps_id: int, op: Optional[ReduceOp], prescale: float, postscale: float,
                   root: int, tensors: tuple, extra: Any = None) -> Signature:
    """Everything ranks must agree on for one name. ``tensors`` is ((dtype, shape), ...)."""
    return (kind, ps_id, None if op is None else op.value, float(prescale), float(postscale), int(root),
            tensors, extra)


class _SignatureFields:
    """Named access to the signature fields the engine reads most (shared by Request and Response)."""

    sig: Signature

    @property
    def kind(self) -> str:
        return self.sig[SIG_KIND]

    @property
    def ps_id(self) -> int:
        return self.sig[SIG_PSET]


@dataclasses.dataclass(eq=False)
class Request(_SignatureFields):
    """One named collective submitted on this rank, waiting for the engine."""

    name: str
    sig: Signature
    handle: Handle
    inputs: list[np.ndarray]
    outputs: list[Optional[np.ndarray]]
    dtypes: list[str]
    op: Optional[ReduceOp] = None
    splits: Optional[np.ndarray] = None
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    cache_bit: int = -1
    cache_version: int = -1
    results: list = dataclasses.field(default_factory=list)
    remaining: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)
        self.remaining = len(self.inputs)


@dataclasses.dataclass
class Response(_SignatureFields):
    """A decision every rank reached identically: run ``name`` now, or fail it with ``error``."""

    name: str
    sig: Signature
    error: Optional[str] = None
    error_kind: str = "mismatch"
    joined: frozenset = frozenset()
    last_joined: int = -1
