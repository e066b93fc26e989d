"""The srun-without-PMI check in hvd.init(): which launch environments are refused, and with what message."""
from __future__ import annotations

import pytest

from hvdlite.core.errors import LaunchError
from hvdlite.core.launch_check import check_launch, expected_world_size

MPICH = "MPICH Version:      5.0.2\nMPICH Release date: ..."
OPENMPI = "Open MPI v5.0.11, package: Open MPI ..."

SRUN_NONE = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
             "SLURM_NTASKS": "2"}
SRUN_PMI2 = {**SRUN_NONE, "SLURM_MPI_TYPE": "pmi2", "PMI_SIZE": "2", "PMI_RANK": "1"}
# mpiexec inside sbatch: hydra started one proxy per node with srun (a step of 1 task), PMI says 2 ranks
HYDRA_IN_SBATCH = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0",
                   "SLURM_NTASKS": "1", "PMI_SIZE": "2", "PMI_RANK": "1"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}  # python run by the script


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_MPI_TYPE", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)

    def apply(values: dict[str, str]) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    return apply


def test_srun_without_pmi_is_refused_with_the_fix(env) -> None:
    env(SRUN_NONE)
    assert expected_world_size() == (2, "SLURM_STEP_NUM_TASKS")
    with pytest.raises(LaunchError) as info:
        check_launch(1, MPICH)
    text = str(info.value)
    assert text.startswith("rank 1 of 2: srun started 2 tasks (--mpi=none)")
    assert "`srun --mpi=pmi2`" in text and "2 independent copies" in text
    with pytest.raises(LaunchError, match=r"`srun --mpi=pmix` \(Open MPI"):
        check_launch(1, OPENMPI)


def test_pmi_plugin_the_library_ignores_is_refused(env) -> None:
    """Open MPI under srun --mpi=pmi2 silently starts singletons: PMI_SIZE=2 but MPI size 1."""
    env(SRUN_PMI2)
    with pytest.raises(LaunchError, match=r"srun started 2 tasks \(--mpi=pmi2\).*`srun --mpi=pmix`"):
        check_launch(1, OPENMPI)


def test_wrong_mpiexec_is_refused(env) -> None:
    env({"PMI_SIZE": "3", "PMI_RANK": "2"})
    with pytest.raises(LaunchError, match=r"rank 2 of 3: the launcher started 3 ranks \(PMI_SIZE=3\)"):
        check_launch(1, OPENMPI)


def test_legitimate_launches_pass(env) -> None:
    check_launch(1, MPICH)               # plain `python train.py`
    env(BATCH_SCRIPT)
    check_launch(1, MPICH)               # python run directly by the batch script: one process
    env(HYDRA_IN_SBATCH)
    check_launch(2, MPICH)               # SLURM_STEP_NUM_TASKS=1 describes hydra's proxy step, not MPI
    env({"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"})
    check_launch(1, MPICH)               # mpiexec -n 1 inside a 2-task step: PMI is the authority
    env(SRUN_PMI2)
    check_launch(2, MPICH)
