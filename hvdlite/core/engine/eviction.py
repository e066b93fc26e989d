"""The response cache's eviction order: its least recently used bit in O(log n) amortised, not O(n) per name.

The victim is the bit with the smallest ``(last_used, bit)`` (the same on every rank). Victims are popped from a
list sorted by that key while the popped key is exact and below every key handed out since the sort; else it is
sorted again.
"""
from __future__ import annotations

import math

_TOP = (math.inf, 0)


class LeastRecent:
    """Picks the response cache's victims from its ``last_used`` list (shared, updated by the cache)."""

    def __init__(self, last_used: list[int]) -> None:
        self.last_used = last_used
        self._order: list[tuple[int, int]] = []  # (last_used, bit) as sorted, largest first: pop() is the least
        self._floor: tuple[float, int] = _TOP  # the least (tick, bit) put since the sort
        self.ready_min: float = math.inf  # the first tick ready() marked bits at since the sort

    def touched(self, tick: int, bit: int) -> None:
        """``put`` gave ``bit`` the tick ``tick``."""
        if (tick, bit) < self._floor:
            self._floor = (tick, bit)

    def victim(self) -> int:
        """The bit with the least ``(last_used, bit)`` (every bit is in use)."""
        last = self.last_used
        order = self._order
        while order:
            used, bit = order.pop()
            if last[bit] != used:
                continue  # re-used since the sort: its new key is at least the floor or ready_min
            if (used, bit) < self._floor and used < self.ready_min:
                return bit
            break
        self._order = order = sorted(((used, bit) for bit, used in enumerate(last)), reverse=True)
        self._floor, self.ready_min = _TOP, math.inf
        return order.pop()[1]


__all__ = ["LeastRecent"]
