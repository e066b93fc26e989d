"""The documented interface between the core and the launcher (``hvdlite.run``): what the launcher may use.

Every other core module is private to the core (``tests/test_layering.py`` checks this).
"""
from __future__ import annotations

from .basics import ccl_built, ddl_built, gloo_built, mpi_built, nccl_built
from .config import Config, environ, getenv
from .engine.mpi import probe_library as probe_mpi_library
from .engine.mpi import ulfm_library as probe_ulfm
from .elastic_wire import (DRIVER_VARIABLE, GENERATION_VARIABLE, JOB_VARIABLE, MIN_NP_VARIABLE, RESTART_VARIABLE,
                           SECRET_VARIABLE, STANDBY_VARIABLE, job_dir, remove_job, remover_command, signature)
from .errors import LaunchError
from .fencing import fence_command, kill_if_same, start_ticks
from .launch_check import int_or_none, launcher_mismatch, launcher_rank, library_family
from .log import LEVELS as LOG_LEVELS, logger

__all__ = ["Config", "environ", "getenv", "launcher_rank", "int_or_none", "library_family", "launcher_mismatch",
           "probe_mpi_library", "probe_ulfm", "logger", "LOG_LEVELS", "LaunchError", "mpi_built", "gloo_built",
           "nccl_built", "ddl_built", "ccl_built", "DRIVER_VARIABLE", "JOB_VARIABLE", "RESTART_VARIABLE",
           "GENERATION_VARIABLE", "SECRET_VARIABLE", "MIN_NP_VARIABLE", "STANDBY_VARIABLE", "signature", "remove_job",
           "job_dir", "remover_command", "fence_command", "kill_if_same", "start_ticks"]
