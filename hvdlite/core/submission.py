"""The one way a collective enters the engine: every Request is built here, its signature once per name."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from .engine import callsite
from .engine.handles import UNSET
from .engine.planes import PlaneBuffer, plane_of
from .engine.requests import Kind, Request, Signature, make_signature, tensor_layout
from .reduce_ops import Accumulation, ReduceOp, check_accumulation, check_reduction

if TYPE_CHECKING:
    from .runtime import State

MEMO_LIMIT = 1 << 16  # names (and unnamed layouts) remembered per job; past it the memo starts again


def layout_of(inputs: Sequence[Any], dtypes: Sequence[str], rows: bool = False) -> tuple[Any, ...]:
    """The signature's ``((dtype, shape), ...)``; with ``rows`` (allgather, alltoall) the shapes past the first
    dimension, which may differ per rank."""
    if len(inputs) == 1:
        return tensor_layout(dtypes[0], tuple(inputs[0].shape[1:] if rows else inputs[0].shape))
    return tuple([(d, tuple(a.shape[1:] if rows else a.shape)) for a, d in zip(inputs, dtypes)])


def submit(st: State, kind: Kind, name: Optional[str], ps_id: int, inputs: Sequence[Any], dtypes: Sequence[str],
           layout: tuple[Any, ...], outputs: Sequence[Any], op: Optional[ReduceOp] = None, prescale: float = 1.0,
           postscale: float = 1.0, root: int = 0, extra: Any = None, value: Any = UNSET, held: Any = None,
           finalize: Optional[Callable[[Any], Any]] = None, splits: Optional[np.ndarray] = None,
           generated: bool = False) -> Request:
    """Hand one request to ``st``'s engine and return it (the caller's handle): every collective of every
    frontend. ``name`` None: a generated one; ``generated``: the caller generated ``name``. Checks, signature and
    the user's line are worked out once per name (per kind for generated names, whose line is each call's) and
    reused while the arguments compare equal. ``inputs``: C-contiguous storage (or PlaneBuffers); an output None
    is made by the engine; ``value``: what the handle returns, ``held``: what it keeps alive."""
    if name is None:
        name, generated = st.names.name(kind.label, None, ps_id), True
    try:
        plane = "" if type(inputs[0] if inputs else None) is not PlaneBuffer else plane_of(inputs, kind, name)
        memo = st.memo.get(kind if generated else name)
        if memo is None or memo.sig != (kind, ps_id, op, prescale, postscale, root, layout, extra, plane):
            memo = _remember(st, kind if generated else name, name, inputs, dtypes, layout, kind, ps_id, op, prescale,
                             postscale, root, extra, plane)
        if generated:  # a name used once: its line is this call's (engine/callsite.py)
            site = callsite.capture()
            req = Request(name, memo.sig, (ps_id, name), inputs, outputs, value, finalize, splits, site)
            req.again = st.names.again(kind.label, ps_id, site)
        else:
            req = Request(name, memo.sig, memo.key, inputs, outputs, value, finalize, splits, memo.site)
        if held is not None:  # (a slot left unset otherwise)
            req.held = held
        st.engine.submit(req)
    except BaseException:
        if generated:
            st.names.give_back(name, ps_id)  # a refused call consumes no generated name (engine/names.py)
        raise
    return req


class Memo(NamedTuple):
    """What the one submit worked out for one name (or one unnamed kind)."""

    sig: Signature
    key: tuple[int, str]  # (process set, name): the engine's tables' key
    site: Optional[callsite.Site]  # the user's line that first submitted the name with this signature


def _remember(st: State, key: Any, name: str, inputs: Sequence[Any], dtypes: Sequence[str],
              layout: tuple[Any, ...], kind: Kind, ps_id: int, op: Optional[ReduceOp], prescale: float,
              postscale: float, root: int, extra: Any, plane: str) -> Memo:
    """The checks a signature needs (errors name ``name``), done once, then its signature and the user's line,
    kept under ``key``."""
    if len(inputs) > 1:
        plane = plane_of(inputs, kind, name)  # mixed planes: the error
    scaled = (prescale, postscale) != (1, 1)
    if kind is Kind.ALLREDUCE:
        if isinstance(extra, Accumulation):  # first: its reason (Adasum is no sum) before Adasum's own conditions
            check_accumulation("allreduce", name, op, dtypes, extra, st.rank)  # type: ignore[arg-type]
        check_reduction("allreduce", name, op, dtypes, scaled, st.psets.size(ps_id))  # type: ignore[arg-type]
    elif kind is Kind.REDUCESCATTER:
        check_reduction("reducescatter", name, op, dtypes, scaled)  # type: ignore[arg-type]
    sig = make_signature(kind, ps_id, op, prescale, postscale, root, layout, extra, plane)
    if len(st.memo) >= MEMO_LIMIT:
        st.memo.clear()
    memo = st.memo[key] = Memo(sig, (ps_id, name), None if key is kind else callsite.capture(3))
    return memo
