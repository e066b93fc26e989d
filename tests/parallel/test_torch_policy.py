"""hvdlite.torch on the policy shared with TensorFlow (hvdlite.core.frontend): sparse reductions by allgather
(results and refusals), SyncBatchNorm's two-pass moments on the world and on a process set (forward, input
gradients and running statistics equal BatchNorm on the concatenated batch), and the re-exported basics."""
from __future__ import annotations

import pytest
import torch

import hvdlite.core as core
import hvdlite.torch as hvd
from hvdlite.torch import mpi_ops

MPI_SIZES = (2, 3)
VARIANTS = ("", "HOROVOD_CPU_OPERATIONS=GLOO")  # again on the torch.distributed (gloo) data plane


def rank_sparse(r: int, dtype: torch.dtype) -> torch.Tensor:
    dense = torch.zeros(5, 2, dtype=dtype)
    dense[r % 5] = r + 1
    dense[(r + 2) % 5] += 3
    return dense.to_sparse()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_sparse_allreduce_results(rank: int, size: int, dtype: torch.dtype, op: str) -> None:
    total = sum(rank_sparse(r, dtype).to_dense() for r in range(size))
    want = total if op == "Sum" else total / size
    got = hvd.synchronize(hvd.sparse_allreduce_async(rank_sparse(rank, dtype), f"sp.{op}.{dtype}", getattr(hvd, op)))
    assert got.is_sparse and got.dtype == want.dtype  # Average of integers: floating point, as torch divides
    if op == "Sum":
        assert torch.equal(got.to_dense(), want)
    else:  # each rank's values are divided before duplicates are summed
        torch.testing.assert_close(got.to_dense(), want)


def test_sparse_allreduce_refusals(rank: int) -> None:
    with pytest.raises(NotImplementedError, match="hvd.Adasum does not support sparse tensors"):
        hvd.sparse_allreduce_async(rank_sparse(rank, torch.float32), "sp.adasum", hvd.Adasum)
    with pytest.raises(NotImplementedError,
                       match="only hvd.Average and hvd.Sum are defined for sparse tensors, got hvd.Min"):
        hvd.sparse_allreduce_async(rank_sparse(rank, torch.float32), "sp.min", hvd.Min)


def batchnorm_case(rank: int, members: list[int], process_set) -> None:
    rows = [2 + r for r in members]  # uneven batches
    g = torch.Generator().manual_seed(5)
    full = torch.randn(sum(rows), 3, 4, generator=g, dtype=torch.float64) * 2 + 1
    up = torch.randn(sum(rows), 3, 4, generator=g, dtype=torch.float64)
    mine = members.index(rank)
    lo = sum(rows[:mine])
    ref = torch.nn.BatchNorm1d(3, momentum=0.3).double()
    sync = hvd.SyncBatchNorm(3, momentum=0.3, process_set=process_set).double()
    for m in (ref, sync):
        with torch.no_grad():
            m.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            m.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    x_full = full.clone().requires_grad_()
    ref_out = ref(x_full)
    (ref_out * up).sum().backward()
    x = full[lo:lo + rows[mine]].clone().requires_grad_()
    out = sync(x)
    (out * up[lo:lo + rows[mine]]).sum().backward()
    torch.testing.assert_close(out, ref_out.detach()[lo:lo + rows[mine]], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, x_full.grad[lo:lo + rows[mine]], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sync.running_mean, ref.running_mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-10, atol=1e-10)


def test_sync_batch_norm_equals_batch_norm_on_the_concatenated_batch(rank: int, size: int) -> None:
    batchnorm_case(rank, list(range(size)), hvd.global_process_set)


@pytest.mark.mpi(min_size=3)
def test_sync_batch_norm_on_a_process_set(rank: int) -> None:
    pair = hvd.add_process_set([0, 1])
    try:
        if rank < 2:
            batchnorm_case(rank, [0, 1], pair)
    finally:
        hvd.remove_process_set(pair)


def test_basics_are_the_cores(rank: int) -> None:
    for name in ("init", "rank", "size", "ProcessSet", "add_process_set", "HorovodInternalError", "Adasum",
                 "Average", "NotInitializedError"):
        assert getattr(hvd, name) is getattr(core, name) and getattr(mpi_ops, name) is getattr(core, name)
        assert name in hvd.__all__ and name in mpi_ops.__all__
