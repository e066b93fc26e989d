"""Elastic training on MPI (``hvd.elastic``): State, ObjectState, run, HostsUpdatedInterrupt (docs/elastic.md)."""
from __future__ import annotations

from ..errors import HorovodInternalError
from .runner import RESIZE_EXIT_CODE, run
from .sampler import ElasticShards
from .state import HostsUpdatedInterrupt, ObjectState, State

__all__ = ["State", "ObjectState", "run", "HostsUpdatedInterrupt", "HorovodInternalError", "ElasticShards",
           "RESIZE_EXIT_CODE"]
