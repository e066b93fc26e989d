"""The ``hvdlite`` logger, with every record prefixed by the rank that wrote it."""
from __future__ import annotations

import logging
import sys
from typing import Any

_rank_label = "?"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.hvd_rank = _rank_label
        return True


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (it may be redirected after import)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


#: Horovod's TRACE level, below DEBUG (Horovod logs every message exchange at it).
TRACE = 5
logging.addLevelName(TRACE, "TRACE")
#: Horovod's level names and the logging level each one means.
LEVELS = {"TRACE": TRACE, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
_FORMAT = "[hvdlite rank %(hvd_rank)s] %(levelname)s: %(message)s"

logger = logging.getLogger("hvdlite")
logger.addFilter(_RankFilter())
if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(_handler)
    logger.propagate = False
logger.setLevel(logging.WARNING)


def set_rank(rank: int | str) -> None:
    """Set the rank shown in front of every log line."""
    global _rank_label
    _rank_label = str(rank)


def set_level(level: str) -> None:
    """Set the logger's level from one of Horovod's level names (LEVELS; Config checked it)."""
    logger.setLevel(LEVELS[level])


def set_timestamps(show: bool) -> None:
    """Show (or hide) the time at the start of every hvdlite log line."""
    fmt = "%(asctime)s " + _FORMAT if show else _FORMAT
    for handler in logger.handlers:
        if isinstance(handler, _StderrHandler):
            handler.setFormatter(logging.Formatter(fmt))
