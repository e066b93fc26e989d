"""The request protocol: collective kinds with their properties, signatures, requests and responses."""
from __future__ import annotations

import enum
import time
from typing import Any, NamedTuple, Optional

import numpy as np

from ..reduce_ops import ReduceOp
from .handles import Handle


class Kind(enum.Enum):
    """A collective, with the properties the engine decides by.

    fusable: several tensors (of several requests) may share one MPI call.
    cacheable: remembered by the response cache, so steady-state agreement is a bit-vector all-reduce.
    join_tolerant: a rank that called join() stands in for it (zeros, no rows, or nothing).
    control: changes the engine's own tables (process sets) instead of moving data.
    multi_tensor: one request may carry several tensors; its result is the list of their results.
    """

    #           label                fusable cacheable join   control multi
    ALLREDUCE = ("allreduce",          True,  True,  True,  False, True)
    ALLGATHER = ("allgather",          True,  True,  True,  False, True)
    BROADCAST = ("broadcast",          True,  True,  True,  False, True)
    REDUCESCATTER = ("reducescatter",  True,  True,  False, False, True)
    ALLTOALL = ("alltoall",            False, True,  False, False, False)
    BARRIER = ("barrier",              False, True,  True,  False, False)
    JOIN = ("join",                    False, False, False, False, False)
    ADD_PROCESS_SET = ("add_process_set",       False, False, False, True, False)
    REMOVE_PROCESS_SET = ("remove_process_set", False, False, False, True, False)

    def __init__(self, label: str, fusable: bool, cacheable: bool, join_tolerant: bool, control: bool,
                 multi_tensor: bool) -> None:
        self.label = label
        self.fusable = fusable
        self.cacheable = cacheable
        self.join_tolerant = join_tolerant
        self.control = control
        self.multi_tensor = multi_tensor

    def __str__(self) -> str:
        return self.label

    def __reduce__(self) -> Any:  # pickle by name: the tuple values are not unique identifiers to pickle
        return (Kind.__getitem__, (self.name,))


class Signature(NamedTuple):
    """Everything the ranks must agree on for one name (compared field by field on a mismatch)."""

    kind: Kind
    ps_id: int
    op: Optional[str]
    prescale: float
    postscale: float
    root: int
    tensors: tuple  # ((dtype name, shape), ...); for allgather/alltoall the shape beyond the first dimension
    extra: Any = None


#: How a mismatch in each field is described to the user.
FIELD_LABELS = {
    "kind": "operation", "ps_id": "process set", "op": "reduce op", "prescale": "prescale_factor",
    "postscale": "postscale_factor", "root": "root rank", "tensors": "tensors", "extra": "arguments",
}


def make_signature(kind: Kind, ps_id: int, op: Optional[ReduceOp], prescale: float, postscale: float,
                   root: int, tensors: tuple, extra: Any = None) -> Signature:
    return _new_signature(Signature, (kind, ps_id, None if op is None else _OP_VALUES[op], float(prescale),
                                      float(postscale), int(root), tensors, extra))


_new_signature = tuple.__new__  # NamedTuple's own __new__ is Python code: this is on the per-op path
_OP_VALUES = {op: op.value for op in ReduceOp}


class _SignatureFields:
    """Named access to the signature fields the engine reads most (shared by Request and Response)."""

    __slots__ = ()
    sig: Signature

    @property
    def kind(self) -> Kind:
        return self.sig.kind

    @property
    def ps_id(self) -> int:
        return self.sig.ps_id


class Request(_SignatureFields):
    """One named collective submitted on this rank, waiting for the engine (a plain slotted record:
    one is made per tensor operation, so its construction is on the per-op path)."""

    __slots__ = ("name", "sig", "handle", "inputs", "outputs", "dtypes", "op", "splits", "submitted",
                 "cache_bit", "cache_version", "results", "remaining")

    def __init__(self, name: str, sig: Signature, handle: Handle, inputs: list[np.ndarray],
                 outputs: list[Optional[np.ndarray]], dtypes: list[str], op: Optional[ReduceOp] = None,
                 splits: Optional[np.ndarray] = None) -> None:
        self.name = name
        self.sig = sig
        self.handle = handle
        self.inputs = inputs
        self.outputs = outputs
        self.dtypes = dtypes
        self.op = op
        self.splits = splits
        self.submitted = time.monotonic()
        self.cache_bit = -1
        self.cache_version = -1
        self.results: list = [None] * len(inputs)
        self.remaining = len(inputs)


class Response(_SignatureFields):
    """A decision every rank reached identically: run ``name`` now, or fail it with ``error``.
    Successful cached decisions are reused every cycle (the response cache keeps one per name)."""

    __slots__ = ("name", "sig", "error", "error_kind", "joined", "last_joined", "key")

    def __init__(self, name: str, sig: Signature, error: Optional[str] = None, error_kind: str = "mismatch",
                 joined: frozenset = frozenset(), last_joined: int = -1) -> None:
        self.name = name
        self.sig = sig
        self.error = error
        self.error_kind = error_kind
        self.joined = joined
        self.last_joined = last_joined
        self.key = (sig.ps_id, name)  # the engine's pending-table key: (process set, name)

    def __repr__(self) -> str:
        return f"Response({self.name!r}, {self.sig!r}, error={self.error!r})"
