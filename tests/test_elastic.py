"""Elastic hvdlite-run on this machine (no root): a rank killed with SIGKILL, the job goes on at a smaller size
from its last commit; --reset-limit stops it. The multi-host versions are in tests/test_elastic_hosts.py."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from cluster.elastic import (ElasticRun, discovery_losing_a_slot, assert_epochs_exact, assert_every_epoch_exact,
                             final_reports, wait_for_progress)
from cluster.fixtures import PYTHON, ROOT, base_env
from conftest import REPORT_DIR_VARIABLE, WORKERS, final_accuracy, worker_reports

EXAMPLE = str(ROOT / "examples" / "pytorch_digits_elastic.py")
#: The example's training, reporting in JSON (the tests below assert on what its ranks report).
WORKER = str(WORKERS / "torch_elastic.py")
EPOCHS = 3


def launch(report_dir: Path, *flags: str, sleep: float = 0.03) -> ElasticRun:
    return ElasticRun([PYTHON, "-m", "hvdlite.run", *flags, PYTHON, WORKER, "--epochs", str(EPOCHS),
                       "--sleep", str(sleep)], env={**base_env(), REPORT_DIR_VARIABLE: str(report_dir)})


@pytest.fixture(scope="module")
def reference_accuracy() -> float:
    """The example itself (what its user sees) on 3 ranks, never interrupted: one ``epoch=`` line per epoch,
    each of which processed every sample once, and its final accuracy."""
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "3", "--min-np", "2", "--max-np", "3", PYTHON, EXAMPLE,
                      "--epochs", str(EPOCHS)])
    assert run.finish(timeout=400) == 0, run.output
    assert "reset" not in run.output.split("job finished")[0].split("joined")[-1]
    assert_every_epoch_exact(run.output, EPOCHS)
    return final_accuracy(run.output)


def test_killed_rank_job_resumes_from_its_last_commit_on_the_same_slots(reference_accuracy: float,
                                                                        tmp_path: Path) -> None:
    """A rank killed once is a process that died, not a lost slot: the job starts again at its full size (restart
    mode under MPICH) from its last commit, and trains to the accuracy of an uninterrupted run."""
    run = launch(tmp_path, "-np", "3", "--min-np", "2", "--max-np", "3")
    ranks = run.rank_pids(3)
    seen = wait_for_progress(tmp_path, lambda p: p["epoch"] == 1 and p["size"] == 3, "a commit in epoch 1", 400, run)
    os.kill(ranks[2][1], signal.SIGKILL)
    assert run.finish(timeout=400) == 0, run.output
    out = run.output
    assert re.search(rf"reset 1: rank 2 on host \S+ \(pid {ranks[2][1]}\) failed; a process that died, not a lost "
                     r"host: its slot is used again \(1 lost rank\(s\) of localhost within 60 s; 3 blacklist it\); "
                     r"starting again", out), out
    assert "starting 3 ranks on localhost:3 (reset 1)" in out, out
    resumed = re.findall(r"rank 0: resumed from commit (\d+), held by rank \d+; 3 ranks now", out)
    assert len(resumed) == 1 and int(resumed[0]) >= seen["commit"], (seen, out)
    final = final_reports(tmp_path, 3, out)  # the 3 ranks agree on the weights and all below
    assert final["resets"] == [{"size": 3, "lr": pytest.approx(0.06)}], out
    assert_epochs_exact(final, EPOCHS, out)
    assert {record["size"] for record in final["epochs"]} == {3}, (final, out)
    accuracy = final["accuracy"]
    assert accuracy >= 0.9 and abs(accuracy - reference_accuracy) <= 0.05, (accuracy, reference_accuracy, out)
    assert "job finished on 3 ranks after 1 reset(s)" in out, out


def test_reset_limit_stops_the_job(tmp_path: Path) -> None:
    run = launch(tmp_path, "-np", "3", "--min-np", "1", "--max-np", "3", "--reset-limit", "1")
    first = run.rank_pids(3)
    wait_for_progress(tmp_path, lambda p: p["size"] == 3, "a commit at size 3", 400, run)
    os.kill(first[1][1], signal.SIGKILL)
    restarted = run.wait_for(r"starting 3 ranks on localhost:3 \(reset 1\)", timeout=400)
    assert restarted, run.output  # (a process that died is not a lost slot: the job starts again at 3)
    second = run.rank_pids(3)
    assert second[1][1] != first[1][1], run.output
    run.wait_for(r"rank 0: resumed from commit \d+", timeout=400)
    os.kill(second[1][1], signal.SIGKILL)
    code = run.finish(timeout=400)
    out = run.output
    assert code != 0, out
    assert re.search(r"stopping: the job needed reset 2 but --reset-limit is 1 \(last: rank 1 on host \S+ "
                     rf"\(pid {second[1][1]}\) failed; .*\); exit code {code}$", out, re.MULTILINE), out
    assert not [entry for entry in worker_reports(tmp_path).values() if "final" in entry], out  # none finished


@pytest.mark.parametrize("legacy_keras", ["0", "1"], ids=["keras3", "tf_keras"])
def test_keras_fit_with_elastic_callbacks_survives_a_killed_rank(legacy_keras: str, tmp_path: Path) -> None:
    """Keras 3, and Keras 2 (tf-keras with TF_USE_LEGACY_KERAS=1): KerasState and the elastic callbacks carry the
    training over a killed rank."""
    script, slot_lost = discovery_losing_a_slot(tmp_path)  # the job goes on at 2 ranks: the reset's new size
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "3", "--min-np", "2", "--max-np", "3",
                      "--host-discovery-script", str(script), PYTHON,
                      str(WORKERS / "keras_elastic.py"), "--epochs", "4", "--sleep", "0.02"],
                     env={**base_env(), "TF_USE_LEGACY_KERAS": legacy_keras, REPORT_DIR_VARIABLE: str(tmp_path)})
    ranks = run.rank_pids(3)
    wait_for_progress(tmp_path, lambda p: p["epoch"] >= 1 and p["size"] == 3, "epoch 1 done at size 3", 400, run)
    slot_lost.touch()
    os.kill(ranks[1][1], signal.SIGKILL)
    assert run.finish(timeout=400) == 0, run.output
    out = run.output
    assert re.search(rf"reset 1: rank 1 on host \S+ \(pid {ranks[1][1]}\) failed", out), out
    resumed = re.findall(r"rank 0: resumed from commit (\d+), held by rank \d+; 2 ranks now", out)
    assert len(resumed) == 1 and int(resumed[0]) >= 1, out
    final = final_reports(tmp_path, 2, out)  # the 2 ranks agree on the weights and all below
    assert final["epoch"] == 4, (final, out)  # finished the 4 epochs on 2 ranks
    assert final["resets"] == [{"size": 2, "lr": pytest.approx(0.04)}], (final, out)
    assert final["accuracy"] >= 0.9, (final, out)


def test_a_program_that_fails_before_training_is_not_restarted(tmp_path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit(3)\n")
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "2", "--min-np", "1", PYTHON, str(broken)])
    code = run.finish(timeout=120)
    assert code == 3, run.output
    assert "stopping: the job exited 3 before any rank reached hvd.elastic.run" in run.output, run.output
    assert run.output.count("starting 2 ranks") == 1, run.output


def _listening_addresses(port: int) -> list[str]:
    """The local IPv4 addresses a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def _files_containing(needle: bytes, roots: list[Path], since: float) -> list[str]:
    """Files under ``roots`` changed since ``since`` (under 4 MB) whose bytes contain ``needle``."""
    hits = []
    for root in roots:
        for directory, _dirs, names in os.walk(root):
            for name in names:
                path = Path(directory) / name
                try:
                    info = path.stat()
                    if info.st_mtime >= since and info.st_size < 4 << 20 and needle in path.read_bytes():
                        hits.append(str(path))
                except OSError:
                    continue
    return hits


def test_driver_listens_on_loopback_and_only_its_ranks_get_in(tmp_path: Path) -> None:
    started = time.time()
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "2", "--min-np", "1", "--max-np", "2", "--verbose",
                      PYTHON, WORKER, "--epochs", "1", "--sleep", "0.02"])
    where = run.wait_for(r"listening for the ranks on (\S+):(\d+)$", timeout=120)
    address, port = where.group(1), int(where.group(2))
    assert address == "127.0.0.1" and _listening_addresses(port) == ["127.0.0.1"], run.output
    ranks = run.rank_pids(2)
    environ = Path(f"/proc/{ranks[0][1]}/environ").read_bytes().split(b"\0")
    secret = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"HVDLITE_ELASTIC_SECRET="))
    assert len(secret) == 64, "the rank got the job's secret in its environment"
    cmdlines = {p.name: (p / "cmdline").read_bytes() for p in Path("/proc").iterdir()
                if p.name.isdigit() and (p / "cmdline").exists()}
    assert str(ranks[0][1]) in cmdlines and not [pid for pid, line in cmdlines.items() if secret in line]
    # a client without the secret claims to be rank 0, then says it is done: refused, logged, no effect
    with socket.create_connection((address, port), timeout=10) as rogue:
        nonce = json.loads(rogue.makefile("r").readline())["nonce"]
        assert len(nonce) == 32
        for message in ({"op": "hello", "rank": 0, "size": 2, "host": "rogue", "pid": 1, "attempt": 0, "seq": 1,
                         "mac": "0" * 64}, {"op": "done", "seq": 2}):
            rogue.sendall((json.dumps(message) + "\n").encode())
        try:  # closed: an orderly end, or a reset when the refused client's second line was still unread
            closed = rogue.recv(1) == b""
        except ConnectionResetError:
            closed = True
        assert closed, "the driver closes a refused connection"
    run.wait_for(r"refused a connection from 127\.0\.0\.1:\d+: its message is not signed with this job's "
                 r"secret", timeout=60)
    assert run.finish(timeout=400) == 0, run.output
    out = run.output
    assert "job finished on 2 ranks after 0 reset(s)" in out, out
    assert "rogue" not in out and out.count(" joined from host ") == 2, out
    assert secret.decode() not in out and "HVDLITE_ELASTIC_SECRET='<hidden>'" in out, out
    assert _files_containing(secret, [Path("/dev/shm"), Path("/tmp")], started) == []


def test_the_driver_removes_the_commits_a_blacklisted_host_left(tmp_path: Path) -> None:
    # each rank leaves a commit as a host would that was blacklisted: no rank of it is left to delete it
    program = tmp_path / "leave_commit.py"
    program.write_text("import os, pathlib\n"
                       "job = pathlib.Path(os.environ['HVDLITE_ELASTIC_COMMIT_DIR']) / "
                       "('hvdlite-elastic-' + os.environ['HVDLITE_ELASTIC_JOB'])\n"
                       "(job / ('gone-' + os.environ['PMI_RANK'])).mkdir(parents=True)\n"
                       "(job / ('gone-' + os.environ['PMI_RANK']) / 'commit.pkl').write_bytes(b'state')\n")
    commits = tmp_path / "commits"
    env = dict(base_env(), HVDLITE_ELASTIC_COMMIT_DIR=str(commits))
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "2", "--min-np", "1", PYTHON, str(program)], env=env)
    assert run.finish(timeout=120) == 0, run.output
    job = re.search(r"job (\w+): hosts from", run.output)
    assert job and "no rank used hvd.elastic.run; the job exited 0: done" in run.output, run.output
    assert commits.is_dir() and list(commits.iterdir()) == [], run.output


def test_a_killed_rank_does_not_lose_the_host_its_discovery_script_lists(tmp_path: Path) -> None:
    """Restart mode (MPICH), a discovery script printing localhost:3: a rank killed once is a process that died,
    not a lost host (the host was blacklisted for good: 'usable now: none' for the whole --elastic-timeout, then
    exit 1): the job starts again on the 3 slots from its last commit and finishes; the shared-memory file of MPICH's
    that the killed job left in /dev/shm is deleted."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:3\n")
    script.chmod(0o755)
    reports = tmp_path / "reports"
    run = launch(reports, "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script))
    ranks = run.rank_pids(3)
    wait_for_progress(reports, lambda p: p["size"] == 3, "a commit at size 3", 400, run)
    os.kill(ranks[1][1], signal.SIGKILL)
    assert run.finish(timeout=400) == 0, run.output
    out = run.output
    assert re.search(rf"reset 1: rank 1 on host \S+ \(pid {ranks[1][1]}\) failed; a process that died, not a lost "
                     r"host: its slot is used again", out), out
    assert "starting 3 ranks on localhost:3 (reset 1)" in out and "usable now" not in out, out
    assert "job finished on 3 ranks after 1 reset(s)" in out, out
    # the killed job's MPICH shared memory (a 1-4 MB /dev/shm/mpich_shm_* its ranks never unlinked) is deleted
    left = re.search(r"deleted (/dev/shm/mpich_shm_\w+), the shared memory MPICH left behind on this host", out)
    assert left and not os.path.exists(left.group(1)), out
    final_reports(reports, 3, out)  # the 3 ranks agree on the weights and all
