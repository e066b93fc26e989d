"""The one configuration object: every knob, read from HVDLITE_/HOROVOD_ variables or init() keywords.

The only module that reads ``os.environ``."""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping, MutableMapping

from .log import LEVELS, logger

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

#: Variables that hvdlite itself sets for its children (the launcher); not knobs, never warned about.
_INTERNAL_VARIABLES = {"HVDLITE_LAUNCHED_BY", "HVDLITE_RUN_FUNC_KEY", "HVDLITE_ELASTIC_DRIVER",
                       "HVDLITE_ELASTIC_JOB", "HVDLITE_ELASTIC_RESTART", "HVDLITE_ELASTIC_GENERATION",
                       "HVDLITE_ELASTIC_SECRET", "HVDLITE_ELASTIC_MIN_NP", "HVDLITE_ELASTIC_STANDBY"}

#: Former settings, and what a user who sets one is told: an init() keyword raises TypeError with it, a
#: variable is ignored with a warning (HOROVOD_GPU_<OP> is Horovod's build-time choice; it is often left set).
REMOVED = {
    **{f"gpu_{op}": f"per-collective GPU planes are gone: every collective of a CUDA tensor takes "
                    f"gpu_operations' plane (HOROVOD_GPU_OPERATIONS); HOROVOD_GPU_{op.upper()} is read by "
                    f"Horovod only when it is built"
       for op in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")},
    "stage_host_copies": "it was a test switch, now hvdlite.torch.tensors.STAGE_HOST_COPIES (tests only)",
}
#: Value of HOROVOD_TIMELINE meaning "no file at init; hvd.start_timeline() starts one later".
DYNAMIC_TIMELINE = "DYNAMIC"


@dataclasses.dataclass
class Config:
    """Every tunable of hvdlite (README's Settings table says what each does). Field ``x`` is read from
    ``HVDLITE_X`` (or ``HOROVOD_X``); a field whose name carries its unit keeps Horovod's variable name without
    it (``cycle_time_ms``: HOROVOD_CYCLE_TIME, see ENV_NAMES)."""

    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024  # response-cache entries (steady state: a bit-vector all-reduce)
    fusion_threshold_bytes: int = 4 * 1024 * 1024  # 0 turns fusion off
    allreduce_chunk_bytes: int = 1024 * 1024  # larger tensors are reduced in place, in pieces of this size
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0  # 0: a stall only warns
    stall_check_disable: bool = False
    timeline: str = ""  # Chrome-trace file of rank 0; "DYNAMIC": none until start_timeline()
    timeline_mark_cycles: bool = False
    log_level: str = "WARNING"  # TRACE, DEBUG, INFO, WARNING, ERROR or FATAL, any case (Horovod's)
    log_hide_time: bool = True
    idle_heartbeat_seconds: float = 1.0  # longest pause of an engine with nothing pending (engine/loop.py)
    abort_on_error: bool = True
    gradient_overlap: str = "auto"  # on, off, or auto: overlap unless compute threads take every core
    elastic_commit_dir: str = ""  # "": /dev/shm when writable, else the temporary directory
    elastic_mode: str = "auto"  # in-process (ULFM), restart, or auto: in-process where the MPI allows it
    gpu_operations: str = ""  # nccl, mpi, gloo, or "": NCCL where every rank has it, else host staging
    cpu_operations: str = "mpi"  # or gloo (torch tensors only): what the tests use to run the device planes
    mpi_cuda_aware: str = "auto"  # whether MPI takes CUDA buffers: auto asks the library; on/off override
    openmpi_iallreduce_algorithm: str = "rabenseifner"  # Open MPI's iallreduce (launch_check.openmpi_iallreduce)
    launch_sentinel: bool = True  # read by hvdlite-run only (run/sentinel.py)
    straggler_window_ops: int = 1000  # 0 turns straggler attribution off
    straggler_window_seconds: float = 0.5
    straggler_threshold_ms: float = 5.0
    join_allows_allgather_broadcast: bool = False  # Horovod raises after a join, as by default here
    deterministic: bool = False  # rank-order reductions: bit-identical results (engine/deterministic.py)
    autotune: bool = False  # needs the ``autotune`` extra (engine/autotune.py)
    autotune_log_file: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8

    #: Settings that shape MPI traffic or verdicts every rank must reach alike; rank 0's values are used.
    AGREED = ("cycle_time_ms", "cache_capacity", "fusion_threshold_bytes", "allreduce_chunk_bytes",
              "stall_check_time_seconds", "stall_shutdown_time_seconds", "stall_check_disable",
              "timeline_mark_cycles", "idle_heartbeat_seconds", "gradient_overlap", "autotune", "gpu_operations",
              "cpu_operations", "straggler_window_ops", "straggler_window_seconds", "straggler_threshold_ms",
              "deterministic", "join_allows_allgather_broadcast", "elastic_mode")
    #: openmpi_iallreduce_algorithm's names (those measured) and their numbers in Open MPI's MCA variable.
    OPENMPI_IALLREDUCE_ALGORITHMS = {"default": 0, "ring": 1, "rabenseifner": 3}
    #: Other variable names a setting is read from (Horovod's own spellings), after HVDLITE_/HOROVOD_<NAME>.
    ALIASES = {"autotune_log_file": ("HVDLITE_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG")}
    #: The <NAME> of HVDLITE_<NAME>/HOROVOD_<NAME> where it is not the field's name in capitals.
    ENV_NAMES = {"cycle_time_ms": "CYCLE_TIME", "fusion_threshold_bytes": "FUSION_THRESHOLD"}
    #: Former init() keywords (and setting() names) without units: still accepted, with a DeprecationWarning.
    DEPRECATED_KEYWORDS = {"cycle_time": "cycle_time_ms", "fusion_threshold": "fusion_threshold_bytes"}

    @classmethod
    def env_keys(cls, name: str) -> tuple[str, ...]:
        """The variables setting ``name`` is read from, first found wins."""
        upper = cls.ENV_NAMES.get(name, name.upper())
        return ("HVDLITE_" + upper, "HOROVOD_" + upper, *cls.ALIASES.get(name, ()))

    @classmethod
    def field_for(cls, keyword: str) -> str:
        """The field a keyword names: itself, or (with a DeprecationWarning) a former name's new field."""
        if keyword in cls.DEPRECATED_KEYWORDS:
            new = cls.DEPRECATED_KEYWORDS[keyword]
            warnings.warn(f"hvdlite setting {keyword!r} is now {new!r} (the unit is in the name); the old "
                          f"name still works but will go", DeprecationWarning, stacklevel=4)
            return new
        return keyword

    def agree(self, world: Any) -> None:
        """Take rank 0's values of the AGREED settings (collective over ``world``), warning where they differ."""
        for name, value in world.bcast({name: getattr(self, name) for name in self.AGREED}, root=0).items():
            mine = getattr(self, name)
            if mine != value:
                logger.warning(f"setting {name} is {mine!r} on rank {world.Get_rank()} but {value!r} on rank 0; "
                               f"using rank 0's value on every rank, since it shapes the MPI traffic all ranks must "
                               f"issue alike. Set {self.env_keys(name)[0]} the same everywhere to silence this.")
                setattr(self, name, value)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def setting(cls, name: str, env: Mapping[str, str]) -> Any:
        """One setting as ``env`` gives it (its default when unset), without from_env's other checks."""
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        key = next((key for key in cls.env_keys(name) if env.get(key) is not None), None)
        return field.default if key is None else _parse(key, env[key], field.type)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a config from the environment, then apply ``init()`` keyword overrides."""
        env = os.environ if env is None else env
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {name: cls.setting(name, env) for name in types}
        known = {cls.env_keys(n)[0] for n in cls.field_names()} | _INTERNAL_VARIABLES
        known |= {key for keys in cls.ALIASES.values() for key in keys if key.startswith("HVDLITE_")}
        for name, why in REMOVED.items():
            for key in cls.env_keys(name):
                if key in env:
                    logger.warning("%s is ignored: %s", key, why)
                    known.add(key)
        for key in sorted(env):
            if key.startswith("HVDLITE_") and key not in known:
                logger.warning("unknown setting %s is ignored; known settings: %s", key,
                               ", ".join(sorted(known - _INTERNAL_VARIABLES)))
        for keyword, value in overrides.items():
            name = cls.field_for(keyword)
            if name in REMOVED:
                raise TypeError(f"init() setting {name!r} was removed: {REMOVED[name]}")
            if name not in types:
                raise TypeError(f"init() got an unknown keyword {name!r}; known settings: "
                                f"{', '.join(cls.field_names())}")
            values[name] = _parse(name, value, types[name]) if isinstance(value, str) else value
        config = cls(**values)
        config.validate()
        return config

    def timeline_at_init(self) -> str:
        """The timeline file to open at init(): "" for none, also for DYNAMIC (start_timeline() opens one)."""
        return "" if self.timeline.strip() == DYNAMIC_TIMELINE else self.timeline

    def validate(self) -> None:
        for name, (least, strict) in _LEAST.items():
            value = getattr(self, name)
            if not (value > least if strict else value >= least):
                raise ValueError(f"{name} must be {'>' if strict else '>='} {least}, got {value}")
        level = str(self.log_level).strip().upper()
        if level not in LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LEVELS)} (any case), got {self.log_level!r}")
        self.log_level = level
        for name, (words, empty) in _WORDS.items():
            given = getattr(self, name)
            word = str(given).strip().lower() or empty
            if "on" in words:
                word = "on" if word in _TRUE else "off" if word in _FALSE else word
            if word not in words:
                raise ValueError(f"{name} ({self.env_keys(name)[0]}) must be one of "
                                 f"{', '.join(w or 'unset' for w in words)} (any case), got {given!r}")
            setattr(self, name, word)


#: Numeric settings' least value, and whether it is excluded.
_LEAST = {"cycle_time_ms": (0, False), "cache_capacity": (0, False), "fusion_threshold_bytes": (0, False),
          "allreduce_chunk_bytes": (0, True), "autotune_warmup_samples": (0, False),
          "autotune_steps_per_sample": (1, False), "autotune_bayes_opt_max_samples": (1, False),
          "autotune_gaussian_process_noise": (0, True)}
#: Settings that take one of a few words (an on/off one also a boolean word), and the word an empty value means.
_WORDS = {"gradient_overlap": (("auto", "on", "off"), "off"), "gpu_operations": (("", "nccl", "mpi", "gloo"), ""),
          "cpu_operations": (("mpi", "gloo"), "mpi"), "mpi_cuda_aware": (("auto", "on", "off"), "auto"),
          "openmpi_iallreduce_algorithm": (tuple(Config.OPENMPI_IALLREDUCE_ALGORITHMS), "default"),
          "elastic_mode": (("auto", "in-process", "restart"), "auto")}


def _parse(key: str, raw: str, kind: Any) -> Any:
    """``raw`` as a value of the field type ``kind`` (a name: the annotations are strings)."""
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
    """The process environment (read-only, but for launch_check.openmpi_iallreduce while MPI starts)."""
    return os.environ


def mpi_ft_launched() -> bool:
    """Whether the launcher turned fault tolerance on here (``mpiexec --with-ft ulfm``: OMPI_MCA_mpi_ft_enable=1)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in _TRUE


def getenv(name: str, default: str | None = None) -> str | None:
    """One environment variable that is not a knob (SLURM_*, PMI_*, OMPI_*...)."""
    return os.environ.get(name, default)
