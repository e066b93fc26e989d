"""The one configuration object: every knob, read from HVDLITE_/HOROVOD_ variables or init() keywords.

This is the only module in hvdlite that reads ``os.environ``; everything else asks it.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping, MutableMapping

from .log import logger

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}

#: Variables that hvdlite itself sets for its children (the launcher); not knobs, never warned about.
_INTERNAL_VARIABLES = {"HVDLITE_LAUNCHED_BY", "HVDLITE_RUN_FUNC_KEY", "HVDLITE_ELASTIC_DRIVER",
                       "HVDLITE_ELASTIC_JOB", "HVDLITE_ELASTIC_RESTART", "HVDLITE_ELASTIC_GENERATION",
                       "HVDLITE_ELASTIC_SECRET", "HVDLITE_ELASTIC_MIN_NP"}

#: Log levels Horovod accepts (any case); TRACE and FATAL map to hvdlite's TRACE and Python's CRITICAL.
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
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
    """Every tunable of hvdlite. Field ``x`` is read from ``HVDLITE_X`` (or ``HOROVOD_X``); a field whose
    name carries its unit keeps Horovod's variable name without it (``cycle_time_ms``: HOROVOD_CYCLE_TIME,
    see ENV_NAMES)."""

    #: Milliseconds between negotiation cycles of the background engine.
    cycle_time_ms: float = 1.0
    #: Number of tensor requests remembered so steady-state agreement is a bit-vector all-reduce.
    cache_capacity: int = 1024
    #: Bytes of small tensors packed into one fusion buffer per MPI call; 0 turns fusion off.
    fusion_threshold_bytes: int = 4 * 1024 * 1024
    #: Tensors larger than this are reduced in place, in pieces of this many bytes, never copied.
    allreduce_chunk_bytes: int = 1024 * 1024
    #: Seconds a tensor may wait for other ranks before a stall warning is logged.
    stall_check_time_seconds: float = 60.0
    #: Seconds after which a stalled tensor fails with an error (0 turns this off).
    stall_shutdown_time_seconds: float = 0.0
    #: Turn the stall inspector off entirely.
    stall_check_disable: bool = False
    #: Path of a Chrome-trace timeline written by rank 0 ("" for none; "DYNAMIC": none until start_timeline()).
    timeline: str = ""
    #: Add a marker to the timeline at every negotiation cycle that ran work.
    timeline_mark_cycles: bool = False
    #: Level of the ``hvdlite`` logger: TRACE, DEBUG, INFO, WARNING, ERROR or FATAL (any case, as Horovod).
    log_level: str = "WARNING"
    #: Leave the time out of hvdlite's log lines (``hvdlite-run --log-with-timestamp`` turns it on).
    log_hide_time: bool = True
    #: Longest pause between rounds while the whole job is idle (then a round runs anyway, for stall
    #: detection); while any rank is busy, idle ranks take part in every round at once.
    idle_heartbeat_seconds: float = 1.0
    #: On an uncaught exception in any thread, print it and abort the whole MPI job promptly.
    abort_on_error: bool = True
    #: When DistributedOptimizer reduces gradients: "on" starts each allreduce from backward (overlap);
    #: "off" starts them all at step()/synchronize(); "auto" overlaps unless the ranks' compute threads
    #: already take every CPU core (then the engine would slow backward down more than overlap gains).
    gradient_overlap: str = "auto"
    #: Directory on each host where elastic ``State.commit()`` keeps the last committed state (node-local,
    #: written atomically); "" picks /dev/shm when it is writable, else the temporary directory.
    elastic_commit_dir: str = ""
    #: What ``hvd.elastic.run`` does when a rank dies: "in-process" recovers on the survivors in the same
    #: processes (needs an MPI with ULFM turned on: Open MPI 5 under ``mpiexec --with-ft ulfm``), "restart"
    #: lets the job end so hvdlite-run starts it again, "auto" (default) recovers in-process where the MPI
    #: allows it. hvdlite-run's ``--elastic-mode`` sets it for the ranks. docs/elastic.md.
    elastic_mode: str = "auto"
    #: Data plane of GPU tensors (Horovod's HOROVOD_GPU_OPERATIONS): "nccl" (torch.distributed's NCCL), "mpi"
    #: (CUDA-aware MPI where the MPI library reports CUDA support, else host staging), or "" (auto: NCCL when
    #: every rank has it, else host staging through MPI). docs/torch.md, "Data planes".
    gpu_operations: str = ""
    #: Data plane of CPU tensors (HOROVOD_CPU_OPERATIONS): "mpi" (hvdlite's engine on host buffers) or "gloo"
    #: (torch.distributed's gloo, torch tensors only; TensorFlow stays on MPI).
    cpu_operations: str = "mpi"
    #: Whether the MPI library takes CUDA device buffers (CUDA-aware MPI): "auto" asks the library (MPI 4.1's
    #: mpi_memory_alloc_kinds, else MPIX_Query_cuda_support), "on"/"off" override it on this rank (a rank's
    #: own fact: the job uses CUDA-aware MPI only where every rank has it). docs/torch.md, "Data planes".
    mpi_cuda_aware: str = "auto"
    #: Open MPI only: the algorithm of its non-blocking allreduce (libnbc), which carries hvdlite's reductions:
    #: rabenseifner (reduce-scatter then allgather; a vector shorter than the largest power of two <= the ranks
    #: would go round the ring instead: the engine pads such vectors with zeros, engine/chunks.py), ring, or
    #: "default": Open MPI's own choice, a binomial tree for every in-place
    #: reduction and every job under 4 ranks, which made a 16-core machine's gradient sync 1.2-1.4x slower
    #: (benchmarks/HISTORY.md, "... and under Open MPI"). Applied before MPI starts, as the MCA variable
    #: OMPI_MCA_coll_libnbc_iallreduce_algorithm unless that is set already (it wins); no effect where MPI was
    #: started before hvd.init(). Every rank must start with the same value (init() checks).
    openmpi_iallreduce_algorithm: str = "rabenseifner"
    #: hvdlite-run starts each rank's program under a small sentinel (hvdlite/run/sentinel.py) that names
    #: the rank when a signal kills it (kill -9, the out-of-memory killer); read by the launcher only.
    launch_sentinel: bool = True

    #: Straggler attribution: the report covers the last this many agreed ops of the global process set; the
    #: ranks exchange their submission times whenever this many are counted (0 turns attribution off).
    straggler_window_ops: int = 1000
    #: ... and at the first cycle with agreed ops after this many seconds on rank 0's clock since the last
    #: exchange, so a slow loop's report fills within seconds (0: only every straggler_window_ops ops).
    straggler_window_seconds: float = 0.5
    #: A rank last in at least half the window's ops by more than this on average is named in one log line.
    straggler_threshold_ms: float = 5.0

    #: After a rank has called join(), let the other ranks' allgather and broadcast run (the joined rank gives
    #: no rows and must not be the root) instead of raising as Horovod does ("Allgather is not supported with
    #: Join at this time"). Off by default, as in Horovod; allreduce and barrier run either way.
    join_allows_allgather_broadcast: bool = False

    #: Reproducible reductions: hvdlite sums (and multiplies) floating-point elements itself, in rank order,
    #: so every result is bit-identical for a given number of ranks whatever the fusion, chunking, cycle time,
    #: autotune, submission order or MPI library (see hvdlite/core/engine/deterministic.py).
    deterministic: bool = False

    #: Tune fusion_threshold_bytes, cycle_time_ms and allreduce_chunk_bytes while training runs (Bayesian optimisation
    #: on rank 0; needs the ``autotune`` extra). See hvdlite/core/engine/autotune.py.
    autotune: bool = False
    #: CSV file rank 0 writes one line per autotune sample to, and the final choice ("" for none).
    #: Also read from HOROVOD_AUTOTUNE_LOG, Horovod's name.
    autotune_log_file: str = ""
    #: Autotune samples measured and discarded first (the job warms up).
    autotune_warmup_samples: int = 3
    #: Whole training steps per autotune sample.
    autotune_steps_per_sample: int = 10
    #: Autotune samples scored (start settings, test points, Gaussian-process proposals) before the best is kept.
    autotune_bayes_opt_max_samples: int = 20
    #: Noise (standard deviation, in units of the scores' spread) the Gaussian process assumes in each score.
    autotune_gaussian_process_noise: float = 0.8

    #: Settings that shape MPI traffic or verdicts every rank must reach alike; rank 0's values are used.
    AGREED = ("cycle_time_ms", "cache_capacity", "fusion_threshold_bytes", "allreduce_chunk_bytes",
              "stall_check_time_seconds", "stall_shutdown_time_seconds", "stall_check_disable",
              "timeline_mark_cycles", "idle_heartbeat_seconds", "gradient_overlap", "autotune", "gpu_operations",
              "cpu_operations", "straggler_window_ops", "straggler_window_seconds", "straggler_threshold_ms",
              "deterministic", "join_allows_allgather_broadcast", "elastic_mode")
    #: openmpi_iallreduce_algorithm's names and their numbers in Open MPI's coll_libnbc_iallreduce_algorithm: the
    #: ones measured (benchmarks/HISTORY.md, "... and under Open MPI")
    OPENMPI_IALLREDUCE_ALGORITHMS = {"default": 0, "ring": 1, "rabenseifner": 3}
    #: Other variable names a setting is read from (Horovod's own spellings), after HVDLITE_/HOROVOD_<NAME>.
    ALIASES = {"autotune_log_file": ("HVDLITE_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG")}
    #: The <NAME> of HVDLITE_<NAME>/HOROVOD_<NAME> where it is not the field's name in capitals: Horovod's
    #: variable names, which have no unit, for fields whose Python names carry one.
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

    def agreed_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.AGREED}

    def adopt(self, root_values: Mapping[str, Any], rank: int) -> list[str]:
        """Take rank 0's values of the agreed settings; return a warning for each one that differed here."""
        warnings = []
        for name, value in root_values.items():
            mine = getattr(self, name)
            if mine != value:
                warnings.append(f"setting {name} is {mine!r} on rank {rank} but {value!r} on rank 0; using "
                                f"rank 0's value on every rank, since it shapes the MPI traffic all ranks must "
                                f"issue alike. Set {self.env_keys(name)[0]} the same everywhere to silence this.")
                setattr(self, name, value)
        return warnings

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def setting(cls, name: str, env: Mapping[str, str]) -> Any:
        """One setting as ``env`` gives it (its default when unset), without from_env's other checks."""
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        for key in cls.env_keys(name):
            if env.get(key) is not None:
                return _parse(key, env[key], field.type)
        return field.default

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a config from the environment, then apply ``init()`` keyword overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name in cls.field_names():
            for key in cls.env_keys(name):
                raw = env.get(key)
                if raw is not None:
                    values[name] = _parse(key, raw, types[name])
                    break
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
        if self.cycle_time_ms < 0:
            raise ValueError(f"cycle_time_ms must be >= 0, got {self.cycle_time_ms}")
        if self.cache_capacity < 0:
            raise ValueError(f"cache_capacity must be >= 0, got {self.cache_capacity}")
        if self.fusion_threshold_bytes < 0:
            raise ValueError(f"fusion_threshold_bytes must be >= 0, got {self.fusion_threshold_bytes}")
        if self.allreduce_chunk_bytes <= 0:
            raise ValueError(f"allreduce_chunk_bytes must be > 0, got {self.allreduce_chunk_bytes}")
        level = str(self.log_level).strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (any case), got {self.log_level!r}")
        self.log_level = level
        overlap = str(self.gradient_overlap).strip().lower()
        overlap = "on" if overlap in _TRUE else "off" if overlap in _FALSE else overlap
        if overlap not in ("auto", "on", "off"):
            raise ValueError(f"gradient_overlap must be auto, on or off, got {self.gradient_overlap!r}")
        self.gradient_overlap = overlap
        gpu = str(self.gpu_operations).strip().lower()
        if gpu not in ("", "nccl", "mpi", "gloo"):
            raise ValueError(f"gpu_operations (HOROVOD_GPU_OPERATIONS) must be NCCL or MPI (hvdlite also takes GLOO: "
                             f"allreduce and broadcast of CUDA tensors through gloo), or unset for automatic; got "
                             f"{self.gpu_operations!r}")
        self.gpu_operations = gpu
        cpu = str(self.cpu_operations).strip().lower() or "mpi"
        if cpu not in ("mpi", "gloo"):
            raise ValueError(f"cpu_operations (HOROVOD_CPU_OPERATIONS) must be MPI or GLOO, got "
                             f"{self.cpu_operations!r}")
        self.cpu_operations = cpu
        aware = str(self.mpi_cuda_aware).strip().lower() or "auto"
        aware = "on" if aware in _TRUE else "off" if aware in _FALSE else aware
        if aware not in ("auto", "on", "off"):
            raise ValueError(f"mpi_cuda_aware (HVDLITE_MPI_CUDA_AWARE) must be auto, on or off, got "
                             f"{self.mpi_cuda_aware!r}")
        self.mpi_cuda_aware = aware
        algorithm = str(self.openmpi_iallreduce_algorithm).strip().lower() or "default"
        if algorithm not in self.OPENMPI_IALLREDUCE_ALGORITHMS:
            raise ValueError(f"openmpi_iallreduce_algorithm (HVDLITE_OPENMPI_IALLREDUCE_ALGORITHM) must be one of "
                             f"{', '.join(self.OPENMPI_IALLREDUCE_ALGORITHMS)}, got "
                             f"{self.openmpi_iallreduce_algorithm!r}")
        self.openmpi_iallreduce_algorithm = algorithm
        mode = str(self.elastic_mode).strip().lower() or "auto"
        if mode not in ("auto", "in-process", "restart"):
            raise ValueError(f"elastic_mode (HVDLITE_ELASTIC_MODE) must be auto, in-process or restart, got "
                             f"{self.elastic_mode!r}")
        self.elastic_mode = mode
        if self.autotune_warmup_samples < 0:
            raise ValueError(f"autotune_warmup_samples must be >= 0, got {self.autotune_warmup_samples}")
        if self.autotune_steps_per_sample < 1:
            raise ValueError(f"autotune_steps_per_sample must be >= 1, got {self.autotune_steps_per_sample}")
        if self.autotune_bayes_opt_max_samples < 1:
            raise ValueError(f"autotune_bayes_opt_max_samples must be >= 1, got "
                             f"{self.autotune_bayes_opt_max_samples}")
        if not self.autotune_gaussian_process_noise > 0:
            raise ValueError(f"autotune_gaussian_process_noise must be > 0, got "
                             f"{self.autotune_gaussian_process_noise}")


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
    """The process environment, for the launcher and the launch checks (read-only by convention, except that
    launch_check.openmpi_iallreduce sets Open MPI's variable while MPI starts, then takes it out again)."""
    return os.environ


def mpi_ft_launched() -> bool:
    """Whether the MPI launcher turned fault tolerance on for this process (Open MPI's ``mpiexec --with-ft
    ulfm`` sets OMPI_MCA_mpi_ft_enable=1 for its ranks)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in _TRUE


def getenv(name: str, default: str | None = None) -> str | None:
    """One environment variable that is not a knob (SLURM_*, PMI_*, OMPI_*...)."""
    return os.environ.get(name, default)
