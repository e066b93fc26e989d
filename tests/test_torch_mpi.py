"""hvdlite.torch under mpiexec -n 2 and -n 3: collectives, gradients, DistributedOptimizer, migration.

One MPI job per size runs the three worker scripts in turn (tests/workers/torch_all.py), since starting
torch in every process costs seconds; each test below checks its part of that job's output.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import WORKERS, run_mpi

OPS_GROUPS = ["topology", "allreduce dtypes and ops", "allreduce in place, async, grouped",
              "allgather broadcast alltoall reducescatter", "sparse_allreduce_async", "gradients",
              "process sets, objects, join, timeline, errors"]
OPTIMIZER_GROUPS = ["equivalence with single-process training", "misuse errors",
                    "unused parameters and requires_grad toggles", "sparse gradients", "SyncBatchNorm",
                    "broadcast_parameters and broadcast_optimizer_state", "join with uneven data"]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def job(request: pytest.FixtureRequest) -> tuple[subprocess.CompletedProcess, int]:
    return run_mpi("torch_all.py", request.param, timeout=300), request.param


def assert_groups_passed(out: str, groups: list[str], n: int, done: int, then: str = "") -> None:
    """Every group printed "OK <group> rank=<r> <then>" on every rank, and each rank finished ``done``
    worker scripts."""
    for group in groups:
        for rank in range(n):
            assert re.search(rf"^OK {re.escape(group)} rank={rank} {then}", out, flags=re.M), \
                f"{group!r} did not pass on rank {rank} ({then or 'any mode'}):\n{out}"
    for rank in range(n):
        assert len(re.findall(rf"^DONE rank={rank}$", out, flags=re.M)) == done, out


def test_collectives_dtypes_handles_gradients_process_sets(job) -> None:
    """tests/workers/torch_ops.py: every collective and dtype (bf16/fp16 on CPU), in-place and
    non-contiguous inputs, handles, every collective's backward against Horovod's formulas (exact values),
    process sets, objects, timeline, errors."""
    proc, n = job
    assert_groups_passed(proc.stdout, OPS_GROUPS, n, done=3)


def test_distributed_optimizer_equals_single_process_training(job) -> None:
    """tests/workers/torch_optimizer.py: SGD+momentum, Adam, AdamW and SGD with
    backward_passes_per_step=2, groups, predivide, clipping, fp16/bf16 compression equal single-process
    training on the concatenated batch with identical weights on every rank; unused and toggled
    parameters, sparse gradients, SyncBatchNorm, broadcast helpers (fresh Adam, lazy state, LBFGS) and
    join with uneven data. Once with each allreduce started from backward (gradient_overlap=on), once with
    all of them started at step() (off)."""
    proc, n = job
    for mode in ("on", "off"):
        assert_groups_passed(proc.stdout, OPTIMIZER_GROUPS, n, done=3, then=f"overlap={mode} ")


def test_collectives_and_optimizer_through_host_staging(nproc: int) -> None:
    """tests/workers/torch_all.py --staged: the same checks with every tensor staged through a host copy,
    the path that CUDA tensors take, so that it runs on machines without a GPU."""
    out = run_mpi("torch_all.py", nproc, args=["--staged"], timeout=300).stdout
    assert_groups_passed(out, OPS_GROUPS + OPTIMIZER_GROUPS, nproc, done=2)


def test_horovod_script_runs_with_only_the_import_changed(job) -> None:
    """tests/workers/torch_horovod_style.py is written against horovod.torch's API; hvdlite appears only
    in its import line."""
    source = (WORKERS / "torch_horovod_style.py").read_text()
    mentions = [line for line in source.splitlines() if "hvdlite" in line]
    assert mentions == ["import hvdlite.torch as hvd"], mentions
    proc, n = job
    found = re.findall(rf"^MIGRATION_OK accuracy=([0-9.]+) size={n}$", proc.stdout, flags=re.M)
    assert len(found) == 1 and float(found[0]) > 0.9, proc.stdout + proc.stderr
