"""Adding and removing process sets: agreed by every rank through the engine, like any collective."""
from __future__ import annotations

from typing import Any

from .process_sets import ProcessSet
from .runtime import state


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set on every rank (all ranks must call this, in the same order)."""
    return state().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (all ranks must call this). Returns True if removed."""
    return state().remove_process_set(process_set)
