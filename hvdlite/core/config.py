"""The one configuration object: every knob, read from HVDLITE_/HOROVOD_ variables or init() keywords.

This is the only module in hvdlite that reads ``os.environ``; everything else asks it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, MutableMapping

from .log import logger

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

#: Variables that hvdlite itself sets for its children (the launcher); not knobs, never warned about.
_INTERNAL_VARIABLES = {"HVDLITE_LAUNCHED_BY"}


@dataclasses.dataclass
class Config:
    """Every tunable of hvdlite. Field ``x`` is read from ``HVDLITE_X`` (or ``HOROVOD_X``)."""

    #: Milliseconds between negotiation cycles of the background engine.
    cycle_time: float = 1.0
    #: Number of tensor requests remembered so steady-state agreement is a bit-vector all-reduce.
    cache_capacity: int = 1024
    #: Bytes of small tensors packed into one fusion buffer per MPI call; 0 turns fusion off.
    fusion_threshold: int = 4 * 1024 * 1024
    #: Tensors larger than this are reduced in place, in pieces of this many bytes, never copied.
    allreduce_chunk_bytes: int = 1024 * 1024
    #: Seconds a tensor may wait for other ranks before a stall warning is logged.
    stall_check_time_seconds: float = 60.0
    #: Seconds after which a stalled tensor fails with an error (0 turns this off).
    stall_shutdown_time_seconds: float = 0.0
    #: Turn the stall inspector off entirely.
    stall_check_disable: bool = False
    #: Path of a Chrome-trace timeline written by rank 0 ("" for none).
    timeline: str = ""
    #: Add a marker to the timeline at every negotiation cycle that ran work.
    timeline_mark_cycles: bool = False
    #: Level of the ``hvdlite`` logger (DEBUG, INFO, WARNING, ERROR).
    log_level: str = "WARNING"
    #: Seconds an idle engine sleeps before it joins one negotiation round anyway (stall detection).
    idle_heartbeat_seconds: float = 1.0
    #: On an uncaught exception in any thread, print it and abort the whole MPI job promptly.
    abort_on_error: bool = True
    #: When DistributedOptimizer reduces gradients: "on" starts each allreduce from backward (overlap);
    #: "off" starts them all at step()/synchronize(); "auto" overlaps unless the ranks' compute threads
    #: already take every CPU core (then the engine would slow backward down more than overlap gains).
    gradient_overlap: str = "auto"
    #: Testing/debug switch: frontends stage CPU tensors through a host copy too, as they do device (CUDA)
    #: tensors, so that the staging path runs on machines without a GPU. Off in use.
    stage_host_copies: bool = False

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a config from the environment, then apply ``init()`` keyword overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name in cls.field_names():
            for prefix in ("HVDLITE_", "HOROVOD_"):
                raw = env.get(prefix + name.upper())
                if raw is not None:
                    values[name] = _parse(prefix + name.upper(), raw, types[name])
                    break
        known = {"HVDLITE_" + n.upper() for n in cls.field_names()} | _INTERNAL_VARIABLES
        for key in sorted(env):
            if key.startswith("HVDLITE_") and key not in known:
                logger.warning("unknown setting %s is ignored; known settings: %s", key,
                               ", ".join(sorted(known - _INTERNAL_VARIABLES)))
        for name, value in overrides.items():
            if name not in types:
                raise TypeError(f"init() got an unknown keyword {name!r}; known settings: "
                                f"{', '.join(cls.field_names())}")
            values[name] = _parse(name, value, types[name]) if isinstance(value, str) else value
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.cycle_time < 0:
            raise ValueError(f"cycle_time must be >= 0 ms, got {self.cycle_time}")
        if self.cache_capacity < 0:
            raise ValueError(f"cache_capacity must be >= 0, got {self.cache_capacity}")
        if self.fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be >= 0 bytes, got {self.fusion_threshold}")
        if self.allreduce_chunk_bytes <= 0:
            raise ValueError(f"allreduce_chunk_bytes must be > 0, got {self.allreduce_chunk_bytes}")
        overlap = str(self.gradient_overlap).strip().lower()
        overlap = "on" if overlap in _TRUE else "off" if overlap in _FALSE else overlap
        if overlap not in ("auto", "on", "off"):
            raise ValueError(f"gradient_overlap must be auto, on or off, got {self.gradient_overlap!r}")
        self.gradient_overlap = overlap


def _parse(key: str, raw: str, kind: Any) -> Any:
    kind = kind if isinstance(kind, str) else kind.__name__
    text = raw.strip()
    try:
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(text)
        if kind == "int":
            return int(float(text))
        if kind == "float":
            return float(text)
        return raw
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not a valid {kind}") from None


def environ() -> MutableMapping[str, str]:
    """The process environment, for the launcher and the launch checks (read-only by convention)."""
    return os.environ


def getenv(name: str, default: str | None = None) -> str | None:
    """One environment variable that is not a knob (SLURM_*, PMI_*, OMPI_*...)."""
    return os.environ.get(name, default)
