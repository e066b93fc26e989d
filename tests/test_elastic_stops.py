"""Stopped ranks (SIGSTOP: a hang, not a death) where no running rank waits for them in the engine: every rank left
of a job stopped, and a rank stopped just before another's death, while the survivors shrink (docs/elastic.md, "A
stopped rank"). Real Open MPI 5 processes with ULFM; jobs that hung here, or waited for ULFM's detector, recover or
restart; and every rank of such a job ends MPI within the finalize limit."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPORT_DIR_VARIABLE, WORKERS, run_mpi
from cluster.fixtures import base_env, run
from test_elastic_inprocess import ROOT_ENV, TRAINING, ULFM_FLAGS, WORKER, _assert_matches_reference, _reports

FINAL = re.compile(r"^final orig=\d+ rank=(\d+) size=(\d+) pid=(\d+) steps=(\d+) .*sha=(\w+)$", re.MULTILINE)


@pytest.mark.timeout(600)
def test_every_rank_left_stopped_is_killed_by_the_driver_and_the_job_restarts(ompi_python: str, nproc: int,
                                                                              tmp_path: Path) -> None:
    """hvdlite-run -np N --min-np 1: at -n 3 rank 2 dies first (the two survivors recover in-process); then every
    rank left stops (SIGSTOP) at step 3, before the first commit. No rank runs to wait for a stopped one and kill it
    (engine/stalls.py), so the job stood still for good. The driver kills each after 4 s stopped, counts them lost,
    and, none left, starts the job again on the same slots (at -n 3, three lost ranks within a minute blacklist
    the host for the 1 s cooldown given) from its last commit (none: the start), which trains to the end with the
    weights of an uninterrupted N-rank run."""
    stoppers = [0, 1]
    deaths = [f"{r}:stop:3" for r in stoppers] + (["2:idle:2"] if nproc == 3 else [])
    proc = run([ompi_python, "-m", "hvdlite.run", "-np", str(nproc), "--min-np", "1", "--max-np", str(nproc),
                "--blacklist-cooldown-range", "1", "1", ompi_python, str(WORKERS / WORKER), *TRAINING,
                *(a for d in deaths for a in ("--die", d))],
               timeout=420, env={**base_env(), **ROOT_ENV})
    out = proc.stdout + proc.stderr
    pids: dict[int, int] = {}  # the first job's (the restarted job's ranks print theirs too)
    for m in re.finditer(r"^start orig=(\d+) pid=(\d+)", out, re.MULTILINE):
        pids.setdefault(int(m.group(1)), int(m.group(2)))
    for orig in stoppers:
        assert re.search(rf"^stopping orig={orig} ", out, re.MULTILINE), out
        assert re.search(rf"elastic: rank {orig} on host \S+ \(pid {pids[orig]}\) has been stopped \(SIGSTOP\) for "
                         r"4 s, and no rank ended it: ending it \(SIGKILL\)",
                         out), out
    if nproc == 3:
        assert re.search(r"recovered from the loss of rank\(s\) \[2\] .*: 2 ranks now", out), out
    assert re.search(r"0 rank\(s\) left, below --min-np 1: .*; starting again", out), out
    assert proc.returncode == 0 and len(re.findall(rf"starting {nproc} ranks on localhost:{nproc}", out)) == 2, out
    assert re.search(rf"job finished on {nproc} ranks after {1 if nproc == 2 else 2} reset\(s\)", out), out
    finals = FINAL.findall(out)
    assert sorted(int(f[0]) for f in finals) == list(range(nproc)) and {f[1] for f in finals} == {str(nproc)}, out
    reference = run_mpi(WORKER, nproc, TRAINING, timeout=300, report_dir=tmp_path / "reference")
    expected = {(f["steps"], f["sha"]) for f in _reports(tmp_path / "reference", "final").values()}
    assert {(int(f[3]), f[4]) for f in finals} == expected, (out, reference.stdout)


@pytest.mark.timeout(600)
def test_a_rank_stopped_as_another_dies_is_killed_by_the_driver_inside_the_shrink(ompi_python: str,
                                                                                 tmp_path: Path) -> None:
    """hvdlite-run -np 4 --min-np 2, ULFM's detector given 60 s: at step 3 rank 3 stops (SIGSTOP) and rank 2 dies.
    The survivors see rank 2's death and shrink; rank 3 never joins the shrink, outside every engine wait that looks
    for stopped ranks, so the shrink waited for ULFM's detector (8.8 s at its default timeout; 60 s here). The
    driver kills it 4 s after its stop; both losses are one recovery, the survivors keep their processes and end
    with the weights of an uninterrupted 2-rank run from the commit they resumed from."""
    reports = tmp_path / "reports"
    reports.mkdir()
    proc = run([ompi_python, "-m", "hvdlite.run", "-np", "4", "--min-np", "2", "--max-np", "4",
                "--mpi-args=--mca mpi_ft_detector_timeout 60", ompi_python, str(WORKERS / WORKER), *TRAINING,
                "--die", "3:stop:3", "--die", "2:idle:3", "--dump-resume", str(tmp_path / "resume")],
               timeout=420, env={**base_env(), **ROOT_ENV, REPORT_DIR_VARIABLE: str(reports)})
    out = proc.stdout + proc.stderr
    starts, finals = _reports(reports, "start"), _reports(reports, "final")
    assert re.search(rf"rank 3 on host \S+ \(pid {starts[3]['pid']}\) has been stopped \(SIGSTOP\) for 4 s, and no "
                     r"rank ended it: ending it \(SIGKILL\)", out), out
    took = [float(t) for t in re.findall(r"recovered from the loss of rank\(s\) \[2, 3\] \(host\(s\) \S+, \S+\) in "
                                         r"([\d.]+) s: 2 ranks now", out)]
    assert len(took) == 2 and max(took) < 40, out  # (the detector's 60 s did not end it)
    assert proc.returncode == 0 and "job finished on 2 ranks after 1 reset(s)" in out, out
    assert len(re.findall(r"starting \d+ ranks on", out)) == 1, out  # never restarted
    assert sorted(finals) == [0, 1] and all(f["pid"] == starts[o]["pid"] for o, f in finals.items()), out
    assert {f["size"] for f in finals.values()} == {2} and len({f["sha"] for f in finals.values()}) == 1, out
    _assert_matches_reference(tmp_path, 2, finals, out, {})


@pytest.mark.timeout(300)
def test_a_rank_that_never_recovered_ends_mpi_within_the_finalize_limit(ompi_python: str, nproc: int) -> None:
    """mpiexec -n N under ULFM, hvd.elastic.run with no rank lost: the last rank stays 10 s outside MPI after its
    training, while the others' MPI_Finalize (Open MPI 5's fault-tolerant one waits for every rank) waits for it.
    Only a process that had recovered used to end MPI within the limit (a CI soak's rank once hung there, declared
    dead by a peer, after its training ended); every rank of a fault-tolerant job now does: with the limit at 3 s
    here (the worker's knob; 60 s in a job), each waiting rank says so and exits without MPI_Finalize.
    hvd.elastic.run, run twice, registers that exit handler once."""
    mpiexec = str(Path(ompi_python).parent / "mpiexec")
    proc = run_mpi("elastic_finalize.py", nproc, ["3", "10"], timeout=240, env=ROOT_ENV, check=False,
                   launcher=[mpiexec, *ULFM_FLAGS, "--mca", "mpi_ft_detector_timeout", "60"], interpreter=ompi_python)
    out = proc.stdout + proc.stderr
    assert len(re.findall(rf"^trained rank=\d total={2 * nproc} ", out, re.MULTILINE)) == nproc, out
    once = re.findall(r"^finalize_at_exit rank=\d call=1$", out, re.MULTILINE)  # (hvd.elastic.run ran twice)
    assert len(once) == nproc and "call=2" not in out, out
    for rank in range(nproc - 1):
        assert re.search(rf"^\[hvdlite rank {rank}\] ERROR: MPI_Finalize has not returned within 3 s \(Open MPI's "
                         r"fault-tolerant MPI_Finalize waits for every other rank.*\): exiting without it, status 0",
                         out, re.MULTILINE), out
    assert re.search(rf"^exiting rank={nproc - 1} ", out, re.MULTILINE), out
