"""hvdlite-run's --output-filename and --prefix-output-with-timestamp under a real Open MPI mpirun and under srun
in a real Slurm cluster: horovodrun's layout DIR/rank.<rank>/{stdout,stderr} (rank zero-padded), each rank's own
lines only, every line stamped when asked, nothing lost at exit, and the sentinel's line for a killed rank."""
from __future__ import annotations

import os
import re
from pathlib import Path
import subprocess

import pytest

from cluster.fixtures import PYTHON, SlurmCluster, run, slurm_cluster

LINES = 3000  # per stream and rank: more than a pipe holds, written just before the program exits
STAMP = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
HOST = os.uname().nodename

#: Each rank (its rank from MPI itself) writes LINES lines to stdout and to stderr, waits for the others, and
#: exits right after a last stdout line without a newline.
PROGRAM = f"""
import sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
r = comm.Get_rank()
out = ''.join(f'out {{r}} {{i}} ' + 'x' * 40 + '\\n' for i in range({LINES}))
err = ''.join(f'err {{r}} {{i}}\\n' for i in range({LINES}))
comm.Barrier()
sys.stdout.write(out)
sys.stderr.write(err)
sys.stdout.write(f'last {{r}}')
"""

#: Rank 1 prints its pid and dies of kill -9 after a barrier; the others print and wait for it forever.
KILLED = """
import os, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
r = comm.Get_rank()
print(f'pid {r} {os.getpid()}', flush=True)
print(f'before {r}', file=sys.stderr, flush=True)
comm.Barrier()
if r == 1:
    os.kill(os.getpid(), 9)
comm.recv(source=1)
"""


def expected_stdout(rank: int) -> str:
    return "".join(f"out {rank} {i} " + "x" * 40 + "\n" for i in range(LINES)) + f"last {rank}"


def expected_stderr(rank: int) -> str:
    return "".join(f"err {rank} {i}\n" for i in range(LINES))


def assert_rank_files(out: Path, nproc: int, stamped: bool) -> None:
    """One folder per rank with exactly stdout and stderr, each the rank's own complete output."""
    assert sorted(p.name for p in out.iterdir()) == [f"rank.{r}" for r in range(nproc)]
    for r in range(nproc):
        folder = out / f"rank.{r}"
        assert sorted(p.name for p in folder.iterdir()) == ["stderr", "stdout"]
        for stream, want in (("stdout", expected_stdout(r)), ("stderr", expected_stderr(r))):
            text = (folder / stream).read_text()
            if stamped:
                lines = text.split("\n")
                prefix = re.compile(STAMP + rf"\[{r}\]<{stream}>:")
                bad = [line for line in lines if line and not prefix.match(line)]
                assert bad == [], f"rank {r} {stream}: lines without the stamp: {bad[:3]}"
                text = "\n".join(prefix.sub("", line, count=1) for line in lines)
            assert text == want, (f"rank {r} {stream}: {len(text)} characters, want {len(want)}; "
                                  f"starts {text[:80]!r}, ends {text[-80:]!r}")


def assert_killed_rank_logged(out: Path) -> None:
    """The sentinel's line for rank 1 is in rank.1/stderr (after its own line), and in no other rank's file."""
    pid = (out / "rank.1" / "stdout").read_text().split()[2]
    err1 = (out / "rank.1" / "stderr").read_text()
    line = (f"hvdlite-run: rank 1 (pid {pid} on host {HOST}) was killed by signal 9 (SIGKILL); the launcher stops "
            f"the other ranks because of it")
    assert err1.startswith(f"before 1\n{line}"), err1
    assert (out / "rank.0" / "stdout").read_text().startswith("pid 0 "), (out / "rank.0" / "stdout").read_text()
    err0 = (out / "rank.0" / "stderr").read_text()
    assert err0.startswith("before 0\n") and "hvdlite-run: rank 1" not in err0, err0


# ------------------------------------------------------------------------------------------------ Open MPI
def test_output_filename_under_open_mpi(ompi_python: str, nproc: int, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "logs"
    proc = run([ompi_python, "-m", "hvdlite.run", "--verbose", "-np", str(nproc), "--output-filename", str(out),
                ompi_python, "-c", PROGRAM], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hvdlite-run: launcher: Open MPI" in proc.stdout, proc.stdout[:2000]
    assert_rank_files(out, nproc, stamped=False)
    for r in range(nproc):  # the console still gets every line
        assert f"out {r} {LINES - 1} " in proc.stdout and f"err {r} {LINES - 1}\n" in proc.stderr


def test_prefix_output_with_timestamp_under_open_mpi(ompi_python: str, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "logs"
    proc = run([ompi_python, "-m", "hvdlite.run", "-np", "3", "--prefix-output-with-timestamp", "--output-filename",
                str(out), ompi_python, "-c", PROGRAM], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_rank_files(out, 3, stamped=True)
    # the console gets every line stamped too (a last line without newline runs into the next rank's line)
    stamped = re.findall(STAMP + r"\[([012])\]<stdout>:(out|last) ", proc.stdout)
    assert sorted(stamped) == sorted([(str(r), "out") for r in range(3)] * LINES + [(str(r), "last") for r in range(3)])
    assert len(re.findall(r"<stdout>:", proc.stdout)) == 3 * (LINES + 1)


def test_killed_rank_logged_under_open_mpi(ompi_python: str, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "logs"
    proc = run([ompi_python, "-m", "hvdlite.run", "-np", "3", "--output-filename", str(out), ompi_python, "-c",
                KILLED], timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert_killed_rank_logged(out)


# ------------------------------------------------------------------------------------------------ srun
@pytest.fixture(scope="session")
def slurm(request: pytest.FixtureRequest) -> SlurmCluster:
    return slurm_cluster(request)


def salloc_run(slurm: SlurmCluster, nproc: int, flags: list[str], program: str) -> subprocess.CompletedProcess:
    return run(["salloc", "-n", str(nproc), PYTHON, "-m", "hvdlite.run", "--verbose", *flags, PYTHON, "-c", program],
               env=slurm.env, timeout=240)


def test_output_filename_under_srun(slurm: SlurmCluster, nproc: int, tmp_path: Path) -> None:
    out = tmp_path / "logs"
    proc = salloc_run(slurm, nproc, ["--output-filename", str(out)], PROGRAM)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(rf"running: .*srun -n {nproc} --mpi=pmi2 ", proc.stdout), proc.stdout[:2000]
    assert_rank_files(out, nproc, stamped=False)


def test_prefix_output_with_timestamp_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "logs"
    proc = salloc_run(slurm, 3, ["--prefix-output-with-timestamp", "--output-filename", str(out)], PROGRAM)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_rank_files(out, 3, stamped=True)


def test_killed_rank_logged_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "logs"
    proc = salloc_run(slurm, 3, ["--output-filename", str(out)], KILLED)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert_killed_rank_logged(out)
