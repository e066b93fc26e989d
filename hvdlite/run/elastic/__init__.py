"""hvdlite-run as the elastic driver (--min-np/--max-np/--host-discovery-script): see docs/elastic.md."""
from __future__ import annotations

from .driver import ElasticDriver, run_elastic

__all__ = ["ElasticDriver", "run_elastic"]
