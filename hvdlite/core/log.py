"""The ``hvdlite`` logger, with every record prefixed by the rank that wrote it."""
from __future__ import annotations

import logging
import sys

_rank_label = "?"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.hvd_rank = _rank_label
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (it may be redirected after import)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


logger = logging.getLogger("hvdlite")
logger.addFilter(_RankFilter())
if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("[hvdlite rank %(hvd_rank)s] %(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
logger.setLevel(logging.WARNING)


def set_rank(rank: int | str) -> None:
    """Set the rank shown in front of every log line."""
    global _rank_label
    _rank_label = str(rank)


def set_level(level: str) -> None:
    """Set the logger's level from a name such as ``"INFO"``."""
    logger.setLevel(level.upper())
