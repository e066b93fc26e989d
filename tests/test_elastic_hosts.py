"""Elastic hvdlite-run across three pretend hosts (network namespaces h1..h3, root only): a rank's host dies
mid-epoch and the job goes on with two from its last commit; when discovery shows the host again the job
grows back at its next commit. Each pretend host has its own /dev/shm (tests/cluster/netns.sh): the commits a
host keeps there are deleted by the driver, through the launcher, when the host is blacklisted or dropped."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.elastic import JOINED, ElasticRun, assert_epochs_exact, final_reports, wait_for_progress, wait_until
from cluster.fixtures import PYTHON, ROOT, NetnsHosts, base_env, netns_hosts, run
from conftest import REPORT_DIR_VARIABLE, WORKERS, worker_reports

#: examples/pytorch_digits_elastic.py's training, reporting in JSON (tests/test_elastic.py runs the example).
WORKER = str(WORKERS / "torch_elastic.py")
EPOCHS = 4
JOB = re.compile(r"job (\w+): hosts from")


@pytest.fixture(scope="module")
def hosts(request: pytest.FixtureRequest) -> NetnsHosts:
    return netns_hosts(request, count=3)


def launch_on_h1(hosts: NetnsHosts, flags: str, report_dir: Path, script_args: str = "") -> ElasticRun:
    mpi_args = shlex.quote(f"-launcher ssh -launcher-exec {hosts.nsrsh}")
    command = (f". {shlex.quote(str(hosts.directory / 'mpi.env'))}; cd {shlex.quote(str(ROOT))}; "
               f"export {REPORT_DIR_VARIABLE}={shlex.quote(str(report_dir))}; "
               f"exec {PYTHON} -m hvdlite.run {flags} --network-interface hvd0 --mpi-args={mpi_args} "
               f"{PYTHON} {WORKER} --epochs {EPOCHS} {script_args}")
    return ElasticRun([hosts.nsrsh, "h1", command])


def test_lost_host_then_host_back(hosts: NetnsHosts, tmp_path: Path) -> None:
    listing = tmp_path / "hosts.txt"
    listing.write_text("h1:1\nh2:1\nh3:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    run = launch_on_h1(hosts, f"-np 3 --min-np 2 --max-np 3 --host-discovery-script {script} "
                              f"--blacklist-cooldown-range 1 2", tmp_path / "reports", "--sleep 0.03")
    first = run.rank_pids(3)
    assert [first[r][0] for r in range(3)] == ["h1", "h2", "h3"], run.output
    job = run.wait_for(JOB.pattern, timeout=10).group(1)
    # the run's directory in each host's own /dev/shm
    shm = {h: hosts.directory / "shm" / h / f"hvdlite-elastic-{job}" for h in ("h1", "h2", "h3")}
    killed_at = wait_for_progress(tmp_path / "reports", lambda p: p["size"] == 3, "a commit at size 3", 400, run)
    wait_until(lambda: all((shm[h] / h / "commit.pkl").exists() for h in shm), "every host's commit", 60, run)
    listing.write_text("h1:1\nh2:1\n")  # h3 goes away: its rank dies, discovery no longer lists it
    os.kill(first[2][1], signal.SIGKILL)
    second = run.rank_pids(2)
    assert [second[r][0] for r in range(2)] == ["h1", "h2"], run.output
    # discovery dropped h3: the driver deleted the copy in h3's /dev/shm (no rank of h3 was left to)
    wait_until(lambda: not shm["h3"].exists(), "the dropped h3's commits deleted", 60, run)
    assert shm["h1"].exists() and shm["h2"].exists(), run.output
    grown_from = wait_for_progress(tmp_path / "reports", lambda p: p["size"] == 2, "a commit at size 2", 400, run)
    listing.write_text("h1:2\nh3:1\n")  # h3 is back, h2 leaves (its rank commits and leaves), h1 takes two
    third = run.rank_pids(3)
    assert [third[r][0] for r in range(3)] == ["h1", "h1", "h3"], run.output
    # h2 was dropped: its rank left its commit to resize; the driver deleted it
    wait_until(lambda: not shm["h2"].exists(), "the dropped h2's commits deleted", 60, run)
    assert run.finish(timeout=500) == 0, run.output
    out = run.output
    assert [h for h in shm if shm[h].exists()] == [] and "could not delete" not in out, out
    # (one lost rank does not blacklist its host: h3 is out because discovery no longer lists it)
    assert re.search(rf"reset 1: rank 2 on host h3 \(pid {first[2][1]}\) failed; a process that died, not a lost "
                     r"host: its slot is used again \(1 lost rank\(s\) of h3 within 60 s", out), out
    assert "starting 2 ranks on h1:1,h2:1 (reset 1)" in out, out
    assert re.search(r"hosts changed \(added: h3; removed: h2; now h1:2,h3:1\)", out), out
    assert "reset 2: hosts changed: the ranks committed and left to resize" in out, out
    assert "starting 3 ranks on h1:2,h3:1 (reset 2)" in out, out
    resumed = [int(n) for n in re.findall(r"rank 0: resumed from commit (\d+), held by rank \d+", out)]
    assert len(resumed) == 2 and resumed[0] >= killed_at["commit"] and resumed[1] >= grown_from["commit"], out
    final = final_reports(tmp_path / "reports", 3, out)  # the 3 ranks agree on the weights and all below
    assert final["resets"] == [{"size": 2, "lr": pytest.approx(0.04)}, {"size": 3, "lr": pytest.approx(0.06)}]
    assert_epochs_exact(final, EPOCHS, out)
    assert final["epochs"][-1]["size"] == 3, (final, out)
    assert final["accuracy"] >= 0.9, (final, out)
    assert "job finished on 3 ranks after 2 reset(s)" in out, out


@pytest.mark.timeout(400)
def test_in_process_mode_a_host_added_by_discovery_joins_at_the_next_commit(
        hosts: NetnsHosts, ompi_python: str, tmp_path: Path) -> None:
    """Open MPI 5 with ULFM (in-process mode), 2 ranks on h1, h2; discovery adds h3 once training runs: the job
    grows to 3 ranks at its next commit through a restart (Open MPI 5.0 cannot grow a running job safely:
    docs/elastic.md, Growth), h3's new rank starts from the weights of the others (synced from the commit the
    job left at), is used (the reset callbacks see size 3), and all three finish with identical weights."""
    listing = tmp_path / "hosts.txt"
    listing.write_text("h1:1\nh2:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    reports = tmp_path / "reports"
    mpi_args = shlex.quote(f"--mca plm_rsh_agent {hosts.nsrsh}")
    command = (f". {shlex.quote(str(hosts.directory / 'mpi.env'))}; cd {shlex.quote(str(ROOT))}; "
               f"export {REPORT_DIR_VARIABLE}={shlex.quote(str(reports))}; "
               f"exec {ompi_python} -m hvdlite.run -np 2 --min-np 2 --max-np 3 --host-discovery-script {script} "
               f"--network-interface hvd0 --mpi-args={mpi_args} {ompi_python} {WORKERS / 'elastic_inprocess.py'} "
               f"--epochs 2 --samples 240 --sleep 0.05")
    job = ElasticRun([hosts.nsrsh, "h1", command])
    assert [job.rank_pids(2)[r][0] for r in range(2)] == ["h1", "h2"], job.output
    job.wait_for(r"^first_step entry=1 size=2 ", timeout=200)
    listing.write_text("h1:1\nh2:1\nh3:1\n")
    grown = job.rank_pids(3)
    assert [grown[r][0] for r in range(3)] == ["h1", "h2", "h3"], job.output
    assert job.finish(timeout=300) == 0, job.output
    out = job.output
    assert re.search(r"elastic: in-process mode: Open MPI v5\S* .*has ULFM", out), out
    assert "hosts changed (added: h3; removed: none; now h1:1,h2:1,h3:1)" in out, out
    assert "reset 1: hosts changed: the ranks committed and left to resize" in out, out
    assert "starting 3 ranks on h1:1,h2:1,h3:1 (reset 1)" in out, out
    assert re.search(r"host\(s\) h3 in use: 3 ranks joined [\d.]+ s after discovery added them \(new hosts join "
                     r"through a restart at a commit boundary, in both modes: Open MPI 5.0 can grow a running job "
                     r"only with Comm.Spawn", out), out
    resumed = re.findall(r"rank 0: resumed from commit (\d+), held by rank \d; 3 ranks now", out)
    assert len(resumed) == 1 and int(resumed[0]) >= 1, out  # the commit the two ranks left at
    assert "job finished on 3 ranks after 1 reset(s)" in out, out
    finals = {orig: entry["final"] for orig, entry in worker_reports(reports).items()}
    assert sorted(finals) == [0, 1, 2], out
    assert all(f["size"] == 3 and f["entries"] == [3] and f["pid"] == grown[o][1] for o, f in finals.items()), finals
    assert len({f["synced"][0] for f in finals.values()}) == 1, finals  # h3's rank got the others' weights
    assert len({f["sha"] for f in finals.values()}) == 1, finals  # identical weights at the end
    assert len(re.findall(r"^reset orig=\d rank=\d size=3 ", out, re.MULTILINE)) == 3, out


@pytest.mark.timeout(900)
def test_sbatch_elastic_job_goes_on_without_a_killed_node(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Inside a 2-node allocation, without a discovery script, the nodes are the hosts: a node whose task is
    killed once is not a lost node (a node is blacklisted when its ranks fail repeatedly): the next srun step
    runs on both nodes again from the last commit, the job finishes there, and no commit is left in h2's own
    /dev/shm."""
    cluster = netns_hosts(request, slurm=True, count=3)
    prefix = (f". {cluster.directory / 'mpi.env'}; export SLURM_CONF={cluster.slurm_conf}; cd {ROOT}; ")
    job_script = tmp_path / "elastic.sbatch"
    reports = tmp_path / "reports"
    job_script.write_text("#!/bin/bash\n#SBATCH -N 2 --ntasks-per-node=1\n"
                          f"export {REPORT_DIR_VARIABLE}={reports}\n"
                          f"exec {PYTHON} -m hvdlite.run --min-np 1 --max-np 2 {PYTHON} {WORKER} --epochs 2 "
                          "--sleep 0.03\n")
    output = tmp_path / "job.out"
    env = base_env()

    def slurm(command: str) -> subprocess.CompletedProcess:
        return run([cluster.nsrsh, "h1", prefix + command], timeout=60, env=env)

    submit = slurm(f"sbatch --parsable -o {output} {job_script}")
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = submit.stdout.strip().split(";")[0].splitlines()[-1]
    try:
        deadline = time.monotonic() + 400
        killed = None
        h2_run = Path()  # the run's directory in h2's own /dev/shm
        while True:
            text = output.read_text() if output.exists() else ""
            joined = {int(m.group(1)): (m.group(3), int(m.group(4))) for m in JOINED.finditer(text)
                      if m.group(2) == "2"}
            progress = worker_reports(reports).get(0, {}).get("progress", {})
            if killed is None and len(joined) == 2 and progress.get("size") == 2 and progress["batch"] >= 10:
                h2_run = cluster.directory / "shm" / "h2" / f"hvdlite-elastic-{JOB.search(text).group(1)}"
                assert (h2_run / "h2" / "commit.pkl").exists(), text
                killed = joined[1]
                os.kill(killed[1], signal.SIGKILL)
            queued = slurm(f"squeue -h -j {job_id} -o %i")
            if queued.returncode == 0 and job_id not in queued.stdout.split():
                break  # (a failed squeue, e.g. a controller timeout under load, says nothing)
            assert time.monotonic() < deadline, f"job {job_id} ran past 400 s:\n{text}"
            time.sleep(0.25)
    finally:
        slurm(f"scancel {job_id}")
    info = slurm(f"scontrol show job {job_id}").stdout
    out = output.read_text()
    assert killed is not None and killed[0] == "h2", out
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info + out
    assert re.search(r"hosts from Slurm job \d+ nodes h1:1,h2:1", out), out
    assert "could not delete" not in out and not h2_run.exists(), out  # h2's rank deleted its own at the end
    assert re.search(rf"reset 1: rank 1 on host h2 \(pid {killed[1]}\) failed; a process that died, not a lost host",
                     out), out
    assert "starting 2 ranks on h1:1,h2:1 (reset 1)" in out, out
    final = final_reports(reports, 2, out)
    assert final["resets"] == [{"size": 2, "lr": pytest.approx(0.04)}], (final, out)
    assert_epochs_exact(final, 2, out)
    assert final["epochs"][-1]["size"] == 2, (final, out)
    assert final["accuracy"] >= 0.8, (final, out)  # two epochs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("found_by", ["ulfm-detector", "stall-inspector"])
def test_in_process_a_stopped_rank_alone_on_its_host_is_ended_by_the_driver(hosts: NetnsHosts, ompi_python: str,
                                                                            tmp_path: Path, found_by: str) -> None:
    """In-process mode (Open MPI 5, ULFM) on h1, h2, h3, one rank each: rank 2, alone on h3, stops (SIGSTOP:
    a hang, not a death). No survivor runs on h3 to end the process (core/fencing.py kills only on its own
    host), so the launcher would wait for it forever. ``ulfm-detector``: ULFM's detector declares it failed,
    the survivors on h1 and h2 recover and report the lost rank's pid and start time with their recovery.
    ``stall-inspector``: the detector is given 60 s, and the stall inspector's verdict (4 s) comes first: the
    survivors ask the driver to end the rank (before, the second verdict ended the job with a StallError).
    Either way the driver, whose rank 2 connection is still open, ends it on h3 through the launcher, and the
    job finishes on two ranks after one reset, the survivors in their own processes with the same weights."""
    worker = f"{ROOT}/tests/workers/elastic_inprocess.py"
    stall = found_by == "stall-inspector"
    detector = " --mca mpi_ft_detector_timeout 60" if stall else ""
    mpi_args = shlex.quote(f"--mca plm_rsh_agent {hosts.nsrsh}{detector}")
    flags = "--stall-check-shutdown-time-seconds 4 " if stall else ""
    reports = tmp_path / "reports"
    command = (f". {shlex.quote(str(hosts.directory / 'mpi.env'))}; cd {shlex.quote(str(ROOT))}; "
               f"export {REPORT_DIR_VARIABLE}={shlex.quote(str(reports))}; "
               f"exec {ompi_python} -m hvdlite.run -np 3 --min-np 2 -H h1:1,h2:1,h3:1 --network-interface hvd0 "
               f"{flags}--mpi-args={mpi_args} {ompi_python} {worker} --epochs 2 --samples 240 --die 2:stop:3")
    proc = run([hosts.nsrsh, "h1", command], timeout=300)  # (without the driver's fencing: hangs till then)
    out = proc.stdout + proc.stderr
    workers = worker_reports(reports)
    starts = {orig: entry["start"]["pid"] for orig, entry in workers.items()}
    finals = {orig: entry["final"] for orig, entry in workers.items() if "final" in entry}
    assert proc.returncode == 0 and sorted(starts) == [0, 1, 2], out
    asked = re.compile(r"rank\(s\) \[2\] \(host\(s\) h3\) answered no probes for 4 s \(stall_shutdown_time_seconds; "
                       r"stopped or wedged\): asked hvdlite-run's elastic driver to end them on their hosts")
    assert (asked.search(out) is not None) == stall, out
    assert re.search(rf"rank 2 on host h3 \(pid {starts[2]}\) was declared failed by the survivors but its process "
                     r"is still there \(stopped or wedged\): ending it \(SIGKILL\)", out), out
    assert f"hvdlite-run: host h3: fencing pid {starts[2]}: killed it (SIGKILL)" in out, out
    assert "job finished on 2 ranks after 1 reset(s)" in out and out.count("starting 3 ranks") == 1, out
    assert "StallError" not in out and "stalled for" not in out, out
    assert sorted(finals) == [0, 1], (finals, out)
    assert all(f["size"] == 2 and f["pid"] == starts[orig] for orig, f in finals.items()), (finals, out)
    assert len({f["sha"] for f in finals.values()}) == 1, (finals, out)
