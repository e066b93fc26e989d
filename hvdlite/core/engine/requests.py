"""The request protocol: collective kinds with their properties, signatures, requests and responses."""
from __future__ import annotations

import enum
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from ..reduce_ops import ReduceOp
from .handles import UNSET, Handle


class Kind(enum.Enum):
    """A collective, with the properties the engine decides by: fusable (tensors of several requests may share one
    MPI call), cacheable (agreed by a response cache bit), control (changes the engine's process sets instead of
    moving data), multi_tensor (a request of several tensors, whose result is the list of theirs)."""

    #           label                fusable cacheable control multi
    ALLREDUCE = ("allreduce",          True,  True,  False, True)
    ALLGATHER = ("allgather",          True,  True,  False, True)
    BROADCAST = ("broadcast",          True,  True,  False, True)
    REDUCESCATTER = ("reducescatter",  True,  True,  False, True)
    ALLTOALL = ("alltoall",            False, True,  False, False)
    BARRIER = ("barrier",              False, True,  False, False)
    JOIN = ("join",                    False, False, False, False)
    ADD_PROCESS_SET = ("add_process_set",       False, False, True, False)
    REMOVE_PROCESS_SET = ("remove_process_set", False, False, True, False)

    def __init__(self, label: str, fusable: bool, cacheable: bool, control: bool, multi_tensor: bool) -> None:
        self.label = label
        self.fusable = fusable
        self.cacheable = cacheable
        self.control = control
        self.multi_tensor = multi_tensor

    def __str__(self) -> str:
        return self.label

    def __reduce__(self) -> Any:  # pickle by name: the tuple values are not unique identifiers to pickle
        return (Kind.__getitem__, (self.name,))

    # Singletons compared by identity hash by identity, in C (Enum's __hash__ is Python code, run per key hashed).
    __hash__ = object.__hash__


class Signature(NamedTuple):
    """Everything the ranks must agree on for one name (compared field by field on a mismatch)."""

    kind: Kind
    ps_id: int
    op: Optional[ReduceOp]  # resolved once, at submit; compared and pickled by name like Kind
    prescale: float
    postscale: float
    root: int
    tensors: tuple[Any, ...]  # ((dtype name, shape), ...); for allgather/alltoall the shape beyond the first dimension
    extra: Any = None
    plane: str = ""  # the data plane that moves the bytes ("" = MPI on host buffers; see core/engine/planes.py)


#: How a mismatch in each field is described to the user.
FIELD_LABELS = {
    "kind": "operation", "ps_id": "process set", "op": "reduce op", "prescale": "prescale_factor",
    "postscale": "postscale_factor", "root": "root rank", "tensors": "tensors",
    "extra": "arguments (for allreduce: the compression's float32 accumulation)",
    "plane": "data plane (the tensors' device: '' is host memory over MPI)",
}


def make_signature(kind: Kind, ps_id: int, op: Optional[ReduceOp], prescale: float, postscale: float,
                   root: int, tensors: tuple[Any, ...], extra: Any = None, plane: str = "") -> Signature:
    """The signature, shared with every equal one made before (a training step makes the same ones again and again)."""
    return shared(Signature(kind, ps_id, op, float(prescale), float(postscale), int(root), tensors, extra, plane))


def shared(sig: Signature) -> Signature:
    """The one signature object equal to ``sig`` (``sig`` itself when it is the first, or its extra argument
    is unhashable). Signatures received in a negotiation round are shared too, so equal ones are identical."""
    if len(_SIGNATURES) >= _INTERN_LIMIT:
        _SIGNATURES.clear()
    try:
        return _SIGNATURES.setdefault(sig, sig)
    except TypeError:  # an unhashable extra argument: not shared
        return sig


def tensor_layout(dtype: str, shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """``((dtype, shape),)``, the signature's tensors for one tensor, shared like signatures."""
    key = (dtype, shape)
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= _INTERN_LIMIT:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = (key,)
    return layout


def batch_keys(sig: Signature) -> tuple[Any, ...]:
    """Fusion: tensors with equal keys may share a batch (reductions also need the same dtype); one per tensor.
    Made once per signature (a round may agree 1,000 new names with one signature)."""
    try:
        return _BATCH_KEYS[sig]
    except KeyError:
        pass
    except TypeError:  # an unhashable extra argument: made each time
        return _batch_keys(sig)
    if len(_BATCH_KEYS) >= _INTERN_LIMIT:
        _BATCH_KEYS.clear()
    keys = _BATCH_KEYS[sig] = _batch_keys(sig)
    return keys


def _batch_keys(sig: Signature) -> tuple[Any, ...]:
    by_dtype = sig.kind is Kind.ALLREDUCE or sig.kind is Kind.REDUCESCATTER
    common = (sig.kind, sig.ps_id, sig.op, sig.prescale, sig.postscale, sig.root, sig.plane, sig.extra)
    return tuple((common, dtype if by_dtype else None) for dtype, _ in sig.tensors)


_INTERN_LIMIT = 1 << 16  # distinct signatures remembered; past it the tables start again
_SIGNATURES: dict[Signature, Signature] = {}
_LAYOUTS: dict[Any, Any] = {}
_BATCH_KEYS: dict[Signature, tuple[Any, ...]] = {}


class Request(Handle):
    """One named collective submitted on this rank, and the handle the caller waits on: one object per op, built
    on the per-op path (few allocations, none that only the garbage collector could free)."""

    __slots__ = ("sig", "key", "inputs", "outputs", "splits", "submitted", "cache_bit", "cache_version", "results",
                 "remaining", "site", "held", "again")
    held: Any  # set by core/submission.submit when asked: what the inputs view, kept alive with the handle
    again: bool  # a generated name's: submitted at a line that made one of its kind before (engine/names.py)
    cache_bit: int  # set with cache_version when the engine takes the request (engine/cache.py PendingBits)
    cache_version: int
    remaining: int  # a request of several tensors: how many have no result yet (set with ``results``)

    # Positional: the one submit calls it without keywords (keywords cost a dict per call).
    def __init__(self, name: str, sig: Signature, key: tuple[int, str], inputs: Sequence[np.ndarray],
                 outputs: Sequence[Optional[np.ndarray]], value: Any = UNSET,
                 finalize: Optional[Callable[[Any], Any]] = None, splits: Optional[np.ndarray] = None,
                 site: Optional[tuple[str, int]] = None) -> None:
        self.name = name  # Handle's fields: see Handle
        self._waiters = None
        self._done = False
        self._result = None
        self._error = None
        self._finalize = finalize
        self._value = value
        self.sig = sig
        self.key = key  # the engine's tables' key: (process set, name)
        self.inputs = inputs
        self.outputs = outputs
        self.splits = splits
        self.submitted = time.monotonic()
        self.results: Optional[list[Any]] = None  # multi-tensor results, made when the first one arrives
        self.site = site  # the user's (file, line): its name's first submission's, or a generated name's own


class Response:
    """A decision every rank reached identically: run ``name`` now, or fail it with ``error``.
    Successful cached decisions are reused every cycle (the response cache keeps one per name)."""

    __slots__ = ("name", "sig", "error", "error_kind", "joined", "last_joined", "key", "batch_keys")

    def __init__(self, name: str, sig: Signature, error: Optional[str] = None, error_kind: str = "mismatch",
                 joined: frozenset[Any] = frozenset(), last_joined: int = -1) -> None:
        self.name = name
        self.sig = sig
        self.error = error
        self.error_kind = error_kind
        self.joined = joined  # the stand-ins; for "behind", those ranks
        self.last_joined = last_joined
        self.key = (sig.ps_id, name)  # the engine's pending-table key: (process set, name)
        self.batch_keys = batch_keys(sig)

    def __repr__(self) -> str:
        return f"Response({self.name!r}, {self.sig!r}, error={self.error!r})"
