"""Horovod torch programs run unchanged: error types, scaling precision, signatures (positional orders
included), ProcessSet from an mpi4py communicator, hvdlite.torch.mpi_ops names, tensors left resizable."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import hvdlite.torch as hvd
import hvdlite.torch.mpi_ops as mpi_ops

MPI_SIZES = (2, 3)

INT_TYPES = (torch.uint8, torch.int8, torch.int32, torch.int64)
HALF_TYPES = (torch.float16, torch.bfloat16)


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's reference: integers scaled in float64, half precision in float32, then cast back."""
    wide = torch.float64 if tensor.dtype in INT_TYPES else torch.float32 if tensor.dtype in HALF_TYPES \
        else tensor.dtype
    return (tensor.to(wide) * torch.tensor(factor, dtype=torch.float64).to(wide)).to(tensor.dtype)


def test_duplicate_name_is_a_value_error(rank: int, size: int) -> None:
    # The last rank submits first and alone (the name cannot complete before its second submission).
    if rank == size - 1:
        handle = hvd.allreduce_async(torch.ones(2), name="torch.dup")
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(torch.ones(2), name="torch.dup")
    hvd.barrier()
    if rank != size - 1:
        handle = hvd.allreduce_async(torch.ones(2), name="torch.dup")
    assert hvd.synchronize(handle).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("dtype", INT_TYPES + (torch.float32, torch.float64) + HALF_TYPES)
def test_prescale_matches_horovods_reference(dtype: torch.dtype, rank: int, size: int) -> None:
    torch.manual_seed(1234)
    low = 0 if dtype == torch.uint8 else -100
    tensor = torch.randint(low, 100, (17, 3)).to(dtype)  # the same on every rank
    for factor in (0.1, 0.37, 1.5, 2.25):
        summed = hvd.allreduce(tensor, op=hvd.Sum, prescale_factor=factor)
        expected = _scaled(tensor, factor)
        if dtype in INT_TYPES:
            expected = (expected.to(torch.int64) * size).to(dtype)
            assert torch.equal(summed, expected), (factor, summed, expected)
        else:
            torch.testing.assert_close(summed.float(), expected.float() * size,
                                       rtol=1e-2 if dtype in HALF_TYPES else 1e-6, atol=0)
        assert summed.dtype == dtype


@pytest.mark.parametrize("dtype", INT_TYPES + HALF_TYPES)
def test_postscale_grouped_and_reducescatter(dtype: torch.dtype, rank: int, size: int) -> None:
    tensor = (torch.arange(size * 4) % 7 + 1).reshape(size * 2, 2).to(dtype)
    total = (tensor.to(torch.int64) * size).to(dtype) if dtype in INT_TYPES else \
        (tensor.float() * size).to(dtype)
    for factor in (0.3, 1.7):
        expected = _scaled(total, factor)
        grouped = hvd.grouped_allreduce([tensor, tensor[:1]], op=hvd.Sum, postscale_factor=factor)
        assert torch.equal(grouped[0], expected) and torch.equal(grouped[1], expected[:1])
        scattered = hvd.reducescatter(tensor, op=hvd.Sum, postscale_factor=factor)
        assert torch.equal(scattered, expected[2 * rank:2 * rank + 2])


def test_half_prescale_does_not_overflow(size: int) -> None:
    got = hvd.allreduce(torch.full((4,), 1e-3, dtype=torch.float16), op=hvd.Sum, prescale_factor=1e5)
    one = (torch.tensor(1e-3, dtype=torch.float16).float() * 1e5).half()
    expected = one
    for _ in range(size - 1):
        expected = (expected.float() + one.float()).half()  # float16 sums round after each addition
    assert torch.isfinite(got).all()
    assert torch.equal(got, torch.full((4,), float(expected), dtype=torch.float16))


def _state_tensors(optimizer: torch.optim.Optimizer) -> dict:
    return {(pid, key): value.clone() for pid, entry in optimizer.state_dict()["state"].items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_broadcast_optimizer_state_with_params_lacking_grad_and_state(opt_name: str, rank: int) -> None:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd_momentum" \
        else torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == 0:  # only the first layer ever gets a gradient, and only on the root
        model[0](torch.ones(2, 3)).sum().backward()
        optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, 0, model)  # Horovod's positional order
    mine = _state_tensors(optimizer)
    root = hvd.broadcast_object(mine, root_rank=0)
    assert sorted(mine) == sorted(root) and len(root) in (2, 6)  # two params of layer 0 have state
    for key, value in root.items():
        assert torch.equal(mine[key], value), key
    assert all(p.grad is None for p in model[1].parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model, process_set=hvd.global_process_set)
    for key, value in root.items():
        assert torch.equal(_state_tensors(optimizer)[key], value)


def test_distributed_optimizer_positional_order_num_groups_seventh(rank: int, size: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    base = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        optimizer = hvd.DistributedOptimizer(base, model.named_parameters(), hvd.Compression.none, 1, hvd.Average,
                                             1.0, 2, None, False, hvd.global_process_set)
    model(torch.full((1, 3), float(rank + 1))).sum().backward()
    optimizer.step()
    # single-process reference: the gradient averaged over every rank's input
    inputs = torch.cat([torch.full((1, 3), float(r + 1)) for r in range(size)])
    (reference(inputs).sum() / size).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-6)
    gathered = hvd.allgather(model.weight.detach().reshape(1, -1))
    assert all(torch.equal(gathered[0], row) for row in gathered)


def test_process_set_from_rank_list_and_from_mpi4py_comm(rank: int, size: int) -> None:
    from mpi4py import MPI  # a Horovod program builds the communicator itself
    members = list(range(1, size))
    comm = MPI.COMM_WORLD.Split(0 if rank in members else MPI.UNDEFINED, key=rank)
    ps = hvd.add_process_set(hvd.ProcessSet(comm))
    try:
        assert ps.ranks == members and ps.included() == (rank in members)
        if rank in members:
            got = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=ps)
            assert got.item() == float(sum(members))
            assert ps.rank() == comm.Get_rank() and ps.size() == comm.Get_size()
    finally:
        hvd.remove_process_set(ps)
        if comm != MPI.COMM_NULL:
            comm.Free()
    listed = hvd.add_process_set(hvd.ProcessSet(ranks_or_comm=[0]))
    try:
        assert listed.ranks == [0] and listed.size() == 1
    finally:
        hvd.remove_process_set(listed)


HOROVOD_MPI_OPS_NAMES = (
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "handle_average_backwards_compatibility",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
    "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll",
    "synchronize", "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
    "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter",
)


def test_mpi_ops_holds_horovods_names(size: int) -> None:
    missing = [n for n in HOROVOD_MPI_OPS_NAMES if not hasattr(mpi_ops, n)]
    assert missing == []
    assert mpi_ops.allreduce(torch.ones(2), op=mpi_ops.Sum).tolist() == [float(size)] * 2
    assert mpi_ops.size() == size and mpi_ops.handle_average_backwards_compatibility(None, False) is hvd.Sum


COLLECTIVES = {
    "allreduce": lambda t: hvd.allreduce(t),
    "allreduce_": lambda t: hvd.allreduce_(t),
    "grouped_allreduce_": lambda t: hvd.grouped_allreduce_([t]),
    "allgather": lambda t: hvd.allgather(t),
    "broadcast": lambda t: hvd.broadcast(t, 0),
    "broadcast_": lambda t: hvd.broadcast_(t, 0),
    "alltoall": lambda t: hvd.alltoall(t),
    "reducescatter": lambda t: hvd.reducescatter(t),
}


@pytest.mark.parametrize("kind", list(COLLECTIVES))
def test_tensors_stay_resizable_after_collectives(kind: str, size: int) -> None:
    tensor = torch.ones(size * 2, 3)
    COLLECTIVES[kind](tensor)
    tensor.resize_(size * 4, 5)  # raised "storage that is not resizable" when .numpy() had pinned it
    assert tensor.shape == (size * 4, 5)
    splits = torch.tensor([2] * size)
    hvd.alltoall(torch.ones(size * 2), splits=splits)
    splits.resize_(size + 1)
