"""hvdlite under a real single-node Slurm cluster that the tests start (tests/cluster/slurm.sh) and stop."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import final_accuracy
from test_faults import _kill_rank_2, killed_reports

from cluster.fixtures import (PYTHON, ROOT, WORKERS, SlurmCluster, assert_ctrl_c_stops_every_rank, assert_topology,
                              run, sbatch_wait, slurm_cluster, topology)

TOPOLOGY = str(WORKERS / "launch_topology.py")
FAULTS = str(WORKERS / "faults.py")
DIGITS = ROOT / "examples" / "pytorch_digits.py"


@pytest.fixture(scope="session")
def slurm(request: pytest.FixtureRequest) -> SlurmCluster:
    return slurm_cluster(request)


def test_srun_pmi2_two_ranks(slurm: SlurmCluster) -> None:
    """`srun -n 2 --mpi=pmi2 python prog.py`: ranks 0 and 1 of size 2 on one node."""
    proc = run(["srun", "-n", "2", "--mpi=pmi2", PYTHON, TOPOLOGY], env=slurm.env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=1, per_host=2)
    assert [r["slurm_procid"] for r in ranks] == ["0", "1"]


def test_srun_without_pmi_refuses_to_train_as_singletons(slurm: SlurmCluster) -> None:
    """`srun -n 2 --mpi=none`: MPI comes up as two size-1 worlds; hvd.init() must fail and name the fix."""
    proc = run(["srun", "-n", "2", "--mpi=none", PYTHON, TOPOLOGY], env=slurm.env, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "HVDLITE_TOPOLOGY" not in proc.stdout
    errors = re.findall(r"LaunchError: (rank \d of 2): srun started 2 tasks \(--mpi=none\).*`srun --mpi=pmi2`",
                        proc.stderr)
    assert sorted(errors) == ["rank 0 of 2", "rank 1 of 2"], proc.stderr


def test_mpiexec_inside_sbatch(slurm: SlurmCluster, tmp_path: Path) -> None:
    """mpiexec inside sbatch (slurm/mpiexec.sbatch): right topology although SLURM_PROCID is the wrong step's."""
    job = sbatch_wait(["--ntasks=2", str(ROOT / "slurm" / "mpiexec.sbatch"), PYTHON, TOPOLOGY],
                      tmp_path / "job.out", timeout=180, env=slurm.env)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    ranks = topology(job.output)
    assert_topology(ranks, hosts=1, per_host=2)
    # what hvdlite must not trust: hydra starts its proxy with srun, so both ranks see SLURM_PROCID=0
    assert [r["slurm_procid"] for r in ranks] == ["0", "0"]


def test_hvdlite_run_inside_sbatch_uses_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    """slurm/hvdlite_run.sbatch: hvdlite-run takes -np from the allocation and runs srun --mpi=pmi2."""
    job = sbatch_wait([str(ROOT / "slurm" / "hvdlite_run.sbatch"), PYTHON, TOPOLOGY, "--exit-code", "5"],
                      tmp_path / "job.out", timeout=180, env=slurm.env)
    running = [line for line in job.output.splitlines() if line.startswith("hvdlite-run: running: ")]
    assert len(running) == 1 and re.search(r"srun -n 2 --mpi=pmi2 ", running[0]), job.output
    assert_topology(topology(job.output), hosts=1, per_host=2)
    assert (job.state, job.exit_code) == ("FAILED", 5), job.output  # rank 1's exit code is the job's


def test_sbatch_cpu_template_trains_digits(slurm: SlurmCluster, tmp_path: Path) -> None:
    """sbatch of slurm/cpu.sbatch runs the torch digits example on 2 ranks to convergence."""
    if not DIGITS.exists():
        pytest.skip(f"{DIGITS.relative_to(ROOT)} does not exist yet")
    job = sbatch_wait([str(ROOT / "slurm" / "cpu.sbatch"), PYTHON, str(DIGITS), "--epochs", "6"],
                      tmp_path / "job.out", timeout=240, env=slurm.env)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    assert final_accuracy(job.output) >= 0.9, job.output  # the last line of rank 0, printed once
    epochs = re.findall(r"^epoch=(\d+) ", job.output, re.MULTILINE)
    assert epochs == [str(e) for e in range(1, 7)], job.output  # rank 0 alone logs each epoch


def test_ctrl_c_stops_every_srun_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    """SIGINT to hvdlite-run inside an allocation stops the srun step and every rank."""
    alloc = run(["salloc", "-n", "2", "--no-shell"], env=slurm.env, timeout=60)
    job = re.search(r"Granted job allocation (\d+)", alloc.stderr)
    assert alloc.returncode == 0 and job, alloc.stderr
    env = {**slurm.env, "SLURM_JOB_ID": job.group(1), "SLURM_NTASKS": "2"}
    try:
        assert_ctrl_c_stops_every_rank([PYTHON, "-m", "hvdlite.run"], env, tmp_path)
    finally:
        run(["scancel", job.group(1)], env=slurm.env, timeout=60)


@pytest.mark.parametrize("sentinel", [True, False], ids=["sentinel", "no-sentinel"])
def test_kill_9_of_one_srun_rank(slurm: SlurmCluster, sentinel: bool) -> None:
    """kill -9 of rank 2's program in a 4-rank allreduce under hvdlite-run's srun ends the step within 10 s;
    srun itself names the task; with the sentinel, hvdlite-run's line names rank 2 and its pid too."""
    alloc = run(["salloc", "-n", "4", "--no-shell"], env=slurm.env, timeout=60)
    job_id = re.search(r"Granted job allocation (\d+)", alloc.stderr)
    assert alloc.returncode == 0 and job_id, alloc.stderr
    env = {**slurm.env, "SLURM_JOB_ID": job_id.group(1), "SLURM_NTASKS": "4"}
    flags = [] if sentinel else ["--no-launch-sentinel"]
    try:
        job, elapsed = _kill_rank_2([PYTHON, "-m", "hvdlite.run", "-np", "4", *flags, PYTHON, FAULTS, "loop"], env)
    finally:
        run(["scancel", job_id.group(1)], env=slurm.env, timeout=60)
    assert job.proc.returncode != 0, job.text
    assert elapsed < 10, f"the step took {elapsed:.1f} s to end after kill -9 of rank 2:\n{job.text}"
    if sentinel:  # the sentinel exits 128+9 after its line; the others were stopped (SIGTERM), not "killed"
        assert killed_reports(job) == [("2", str(job.pids[2]), "9", "SIGKILL")], job.text
        assert re.search(r"^srun: error: \S+: task 2: Exited with exit code 137$", job.text, re.M), job.text
    else:
        assert killed_reports(job) == [], job.text
        assert re.search(r"^srun: error: \S+: task 2: Killed$", job.text, re.M), job.text
