"""Elastic hvdlite-run on this machine (no root): a rank killed with SIGKILL, the job goes on at a smaller size
from its last commit; --reset-limit stops it. The multi-host versions are in tests/test_elastic_hosts.py."""
from __future__ import annotations

import os
import re
import signal

import pytest

from cluster.elastic import ElasticRun, assert_every_epoch_exact, epoch_lines, final_accuracy
from cluster.fixtures import PYTHON, ROOT

EXAMPLE = str(ROOT / "examples" / "pytorch_digits_elastic.py")
EPOCHS = 3


def launch(*flags: str, sleep: float = 0.03) -> ElasticRun:
    return ElasticRun([PYTHON, "-m", "hvdlite.run", *flags, PYTHON, EXAMPLE, "--epochs", str(EPOCHS),
                       "--sleep", str(sleep)])


@pytest.fixture(scope="module")
def reference_accuracy() -> float:
    """The same training on 3 ranks, never interrupted."""
    run = launch("-np", "3", "--min-np", "2", "--max-np", "3", sleep=0)
    assert run.finish(timeout=400) == 0, run.output
    assert "reset" not in run.output.split("job finished")[0].split("joined")[-1]
    assert_every_epoch_exact(run.output, EPOCHS)
    return final_accuracy(run.output)


def test_killed_rank_job_resumes_on_fewer_slots(reference_accuracy: float) -> None:
    run = launch("-np", "3", "--min-np", "2", "--max-np", "3")
    ranks = run.rank_pids(3)
    seen = run.wait_for(r"^commit=(\d+) epoch=1 batch=\d+ size=3$", timeout=400)
    os.kill(ranks[2][1], signal.SIGKILL)
    assert run.finish(timeout=400) == 0, run.output
    out = run.output
    assert re.search(rf"reset 1: rank 2 on host \S+ \(pid {ranks[2][1]}\) failed; one slot of localhost blacklisted "
                     r"for good; starting again", out), out
    assert "starting 2 ranks on localhost:2 (reset 1)" in out, out
    resumed = re.findall(r"rank 0: resumed from commit (\d+), held by rank \d+; 2 ranks now", out)
    assert len(resumed) == 1 and int(resumed[0]) >= int(seen.group(1)), out
    assert "reset: size=2 lr=0.0400" in out, out
    assert_every_epoch_exact(out, EPOCHS)
    sizes = [line["size"] for line in epoch_lines(out)]
    assert sizes[0] == "3" and sizes[-1] == "2", out
    accuracy = final_accuracy(out)
    assert accuracy >= 0.9 and abs(accuracy - reference_accuracy) <= 0.05, (accuracy, reference_accuracy, out)
    assert "job finished on 2 ranks after 1 reset(s)" in out, out


def test_reset_limit_stops_the_job() -> None:
    run = launch("-np", "3", "--min-np", "1", "--max-np", "3", "--reset-limit", "1")
    first = run.rank_pids(3)
    run.wait_for(r"^commit=\d+ epoch=0 batch=\d+ size=3$", timeout=400)
    os.kill(first[1][1], signal.SIGKILL)
    second = run.rank_pids(2)
    run.wait_for(r"^commit=\d+ epoch=\d+ batch=\d+ size=2$", timeout=400)
    os.kill(second[1][1], signal.SIGKILL)
    code = run.finish(timeout=400)
    out = run.output
    assert code != 0, out
    assert re.search(r"stopping: the job needed reset 2 but --reset-limit is 1 \(last: rank 1 on host \S+ "
                     rf"\(pid {second[1][1]}\) failed; .*\); exit code {code}$", out, re.MULTILINE), out
    assert "test_accuracy=" not in out.split("reset 1")[-1].split("stopping")[-1]


def test_keras_fit_with_elastic_callbacks_survives_a_killed_rank() -> None:
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "3", "--min-np", "2", "--max-np", "3", PYTHON,
                      str(ROOT / "tests" / "workers" / "keras_elastic.py"), "--epochs", "4", "--sleep", "0.02"])
    ranks = run.rank_pids(3)
    run.wait_for(r"^epoch=1 size=3 commit=\d+$", timeout=400)
    os.kill(ranks[1][1], signal.SIGKILL)
    assert run.finish(timeout=400) == 0, run.output
    out = run.output
    assert re.search(rf"reset 1: rank 1 on host \S+ \(pid {ranks[1][1]}\) failed", out), out
    resumed = re.findall(r"rank 0: resumed from commit (\d+), held by rank \d+; 2 ranks now", out)
    assert len(resumed) == 1 and int(resumed[0]) >= 1, out
    assert "reset: size=2" in out, out
    epochs = re.findall(r"^epoch=(\d+) size=(\d) ", out, re.MULTILINE)
    assert epochs[-1] == ("4", "2") and ("1", "3") in epochs, out  # finished the 4 epochs on 2 ranks
    assert "final_epoch=4" in out, out
    assert final_accuracy(out) >= 0.9, out


def test_a_program_that_fails_before_training_is_not_restarted(tmp_path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit(3)\n")
    run = ElasticRun([PYTHON, "-m", "hvdlite.run", "-np", "2", "--min-np", "1", PYTHON, str(broken)])
    code = run.finish(timeout=120)
    assert code == 3, run.output
    assert "stopping: the job exited 3 before any rank reached hvd.elastic.run" in run.output, run.output
    assert run.output.count("starting 2 ranks") == 1, run.output
