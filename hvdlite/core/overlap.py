"""The gradient_overlap policy: whether frontends start gradient reductions during backward, agreed per set."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .affinity import core_sharing
from .engine.requests import Kind
from .process_sets import ProcessSet
from .reduce_ops import ReduceOp
from .runtime import state
from .submission import layout_of, submit


def local_overlap_verdict(compute_threads: Optional[int]) -> bool:
    """This rank's own view: "auto" overlaps when every rank on the node has a core for its engine besides its
    ``compute_threads`` (None: backward runs on an accelerator)."""
    current = state()
    setting = current.config.gradient_overlap
    if setting != "auto":
        return setting == "on"
    if compute_threads is None:
        return True
    sharing, mine = core_sharing(current.local_size)
    return mine >= sharing * (compute_threads + 1)


def gradient_overlap(compute_threads: Optional[int], process_set: Optional[ProcessSet] = None) -> bool:
    """Whether a frontend starts gradient reductions during backward: every member calls this, and the set
    overlaps only if every member's view says so (so all issue the same collectives)."""
    current = state()
    verdict = local_overlap_verdict(compute_threads)
    if current.config.gradient_overlap != "auto":
        return verdict  # the setting itself is agreed at init()
    ps = process_set if process_set is not None else current.psets.sets[0]
    ps_id = ps.process_set_id or 0
    name = current.names.name("gradient_overlap.agreement", None, ps_id)
    vote = (np.array([int(verdict)], dtype=np.int32),)
    handle = submit(current, Kind.ALLREDUCE, name, ps_id, vote, ("int32",), layout_of(vote, ("int32",)), (None,),
                    op=ReduceOp.MIN, generated=True)
    return bool(handle.wait()[0][0])
