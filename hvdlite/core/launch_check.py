"""Launch checks: catch jobs started so that MPI cannot see its peers (e.g. srun without PMI)."""
from __future__ import annotations

from .config import getenv
from .errors import LaunchError


def check_launch(mpi_size: int) -> None:
    """Raise LaunchError when the launcher started several tasks but MPI sees a singleton."""
    if mpi_size != 1:
        return
    step_tasks = getenv("SLURM_STEP_NUM_TASKS")
    if step_tasks is not None and getenv("SLURM_STEP_ID") not in (None, "batch", "extern") \
            and int(step_tasks) > 1 and getenv("PMI_RANK") is None and getenv("OMPI_COMM_WORLD_SIZE") is None:
        raise LaunchError(
            f"srun started {step_tasks} tasks but MPI came up with size 1 in each: the ranks cannot see "
            f"each other, so training would run as {step_tasks} independent copies. Launch with "
            f"`srun --mpi=pmi2` (MPICH) or `srun --mpi=pmix` (Open MPI), or set MpiDefault in slurm.conf.")
