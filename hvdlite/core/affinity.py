"""CPU affinity arithmetic: how many cores this rank may use, and how many ranks share them."""
from __future__ import annotations

import os


def cpu_cores() -> tuple[int, int]:
    """(cores this process may run on, cores of the machine)."""
    total = os.cpu_count() or 1
    try:
        return len(os.sched_getaffinity(0)), total
    except (AttributeError, OSError):  # not on Linux
        return total, total


def core_sharing(local_size: int) -> tuple[int, int]:
    """(ranks that share this rank's cores, those cores): unbound ranks share the whole node's cores."""
    mine, machine = cpu_cores()
    return (local_size if mine == machine else 1), mine
