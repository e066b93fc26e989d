"""Horovod torch programs run unchanged: error types, scaling precision, signatures (positional orders
included), ProcessSet from an mpi4py communicator, hvdlite.torch.mpi_ops names, tensors left resizable; and
the GPU settings' plane choice without a GPU: CUDA-aware MPI detected truthfully, agreed across ranks (staging
with the reason where one rank lacks it), NCCL asked for and missing, and the CUDA-aware MPI plane's code run
on CPU tensors through real MPI."""
from __future__ import annotations

import ctypes
import logging
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import hvdlite.torch as hvd
import hvdlite.torch.mpi_ops as mpi_ops
import hvdlite.core as core
from hvdlite.core.frontend import PlaneBuffer
from hvdlite.core.runtime import state
from hvdlite.torch import tensors
from hvdlite.torch.plane import FACTORY

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
    # Horovod's start on the ranks without state: zero gradients and one local step (the root had state)
    assert all((p.grad is None) == (rank == 0) for p in model[1].parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=model, process_set=hvd.global_process_set)
    for key, value in root.items():
        assert torch.equal(_state_tensors(optimizer)[key], value)


class _ModelNoGrad(torch.nn.Module):
    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(a.int(), requires_grad=False)
        self.b = torch.nn.Parameter(b)


@pytest.mark.parametrize("wrapped", [False, True])
def test_broadcast_optimizer_state_steps_a_fresh_optimizer_on_zero_gradients(wrapped: bool, rank: int) -> None:
    """Horovod's test_broadcast_state_no_grad and its initialisation: an optimizer without state is stepped
    once locally on zero gradients (parameters without requires_grad keep None), so Horovod's programs that
    read the gradients after broadcast_optimizer_state find them; weight decay moves the weights once."""
    torch.manual_seed(rank)
    model = _ModelNoGrad(torch.tensor([1.0, 3.0]), torch.rand(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    if wrapped:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    b = model.b.detach().clone()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    grad = optimizer.param_groups[0]["params"][1].grad
    assert optimizer.param_groups[0]["params"][0].grad is None
    assert torch.equal(grad, torch.zeros(4)) and torch.equal(hvd.broadcast(grad, root_rank=0), grad)
    decayed = torch.zeros(4).add(b, alpha=1e-6)  # torch's SGD on a zero gradient: weight decay, momentum, nesterov
    assert torch.equal(optimizer.state[model.b]["momentum_buffer"], decayed)
    assert torch.equal(model.b.detach(), b.clone().add_(decayed.add(decayed, alpha=0.9), alpha=-0.001))


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


def _mpich_gpu_query(kind: int) -> "int | None":
    """MPICH's own answer, through its other query (MPIX_GPU_query_support, kind 0 = CUDA); None elsewhere."""
    for path in sorted({line.split()[-1] for line in open("/proc/self/maps") if "/libmpi" in line}):
        lib = ctypes.CDLL(path)
        if hasattr(lib, "MPIX_GPU_query_support"):
            flag = ctypes.c_int(-1)
            assert lib.MPIX_GPU_query_support(kind, ctypes.byref(flag)) == 0
            return flag.value
    return None


def test_cuda_aware_mpi_is_detected_truthfully_and_build_flags_tell_the_truth(reinit: Any) -> None:
    from mpi4py import MPI
    reinit()  # this job's first init() ran before hvdlite.torch registered its planes (tests/parallel/conftest.py)
    aware, how = FACTORY.mpi_cuda
    assert " ".join(MPI.Get_library_version().split()[:3]) in how  # names the library mpi4py loaded
    mpich = _mpich_gpu_query(0)
    if mpich is not None:  # MPICH (pip's here) answers through a second interface too
        assert aware is bool(mpich) and f"returned {mpich}" in how, how
    assert hvd.mpi_built() and hvd.cuda_built() is torch.backends.cuda.is_built()
    assert hvd.nccl_built() is (torch.distributed.is_nccl_available() and torch.backends.cuda.is_built())
    assert state().planes.has("mpi_cuda") is (aware and torch.cuda.is_available())
    if not state().planes.has("mpi_cuda"):
        assert tensors.gpu_plane("allreduce", "float32") == ("nccl" if state().planes.has("nccl") else "")


def _staging_reason(kind: str, dtype: str, fresh: bool = True) -> tuple[str, list[str]]:
    """gpu_plane's answer and the debug lines it logged (``fresh``: as if no reason had been logged yet)."""
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger, level = logging.getLogger("hvdlite"), logging.getLogger("hvdlite").level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    if fresh:
        tensors._LOGGED.clear()
    try:
        return tensors.gpu_plane(kind, dtype), records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_ranks_disagreeing_on_cuda_aware_mpi_all_stage(rank: int, size: int, reinit: Any) -> None:
    """Rank 0 says its MPI is CUDA-aware, the others' libraries say not: every rank stages (one debug line
    saying why), none takes the MPI plane, so none can mismatch."""
    reinit(mpi_cuda_aware="on" if rank == 0 else "off", gpu_operations="MPI")
    assert not state().planes.has("mpi_cuda") and state().planes.lacking("mpi_cuda") == list(range(1, size))
    plane, logged = _staging_reason("allreduce", "float32")
    assert plane == ""
    want = f"rank(s) {list(range(1, size))} is not" if rank == 0 else "this rank's MPI is not CUDA-aware"
    assert len(logged) == 1 and "allreduce go through host staging" in logged[0] and want in logged[0], logged
    assert _staging_reason("allreduce", "float32", fresh=False) == ("", [])  # one line per reason, not per op


def test_nccl_asked_for_and_missing_is_an_error_naming_the_fix(reinit: Any) -> None:
    if state().planes.has("nccl"):
        pytest.skip("NCCL is available here: tests/gpu_check.py covers the GPU cases")
    reinit(gpu_operations="NCCL")
    for kind in ("allreduce", "broadcast"):
        with pytest.raises(RuntimeError, match=f"{kind} of a cuda tensor: HOROVOD_GPU_OPERATIONS asks for NCCL, but "
                                               f"NCCL is not available on every rank.*set it to MPI"):
            tensors.gpu_plane(kind, "float32")


def test_cuda_aware_mpi_plane_on_cpu_tensors(rank: int, size: int, reinit: Any) -> None:
    """With every rank's MPI taken as CUDA-aware, MPI is chosen for every collective and dtype it can run
    (float16 reductions stage), and the plane's code (fusion, scaling, bool, uneven rows and splits) gives
    exact results through real MPI; CPU tensors stand in for device memory (MPI takes them by DLPack)."""
    reinit(mpi_cuda_aware="on", gpu_operations="MPI")
    for kind in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"):
        assert tensors.gpu_plane(kind, "float32") == "mpi_cuda"
    assert _staging_reason("allreduce", "float16")[0] == "" and tensors.gpu_plane("allgather", "float16") == "mpi_cuda"
    plane = state().planes.plane("mpi_cuda", 0)  # its own communicator: the test thread may call it
    n, r = size, rank
    a, b = torch.arange(5, dtype=torch.float32) + r, torch.full((2, 3), float(r + 1))
    got = plane.allreduce([a, b], [None, b], "float32", hvd.Sum, 2.0, 0.5)
    assert torch.equal(got[0], sum(torch.arange(5.0) + i for i in range(n))) and got[1] is b
    assert torch.equal(b, torch.full((2, 3), float(sum(range(1, n + 1)))))
    for op, want in ((hvd.Min, 1), (hvd.Max, n), (hvd.Product, np.prod(range(1, n + 1)))):
        out = plane.allreduce([torch.tensor([r + 1], dtype=torch.int32)], [None], "int32", op, 1.0, 1.0)[0]
        assert out.tolist() == [want] and out.dtype == torch.int32
    flags = plane.allreduce([torch.tensor([r == 0, False])], [None], "bool", hvd.Sum, 1.0, 1.0)[0]
    assert flags.tolist() == [True, False]
    rows = [[i + 1, 2] for i in range(n)]
    got = plane.allgather([torch.full((r + 1, 2), r, dtype=torch.int16), torch.full((2,), r + 0.5)], rows)
    assert torch.equal(got[0], torch.cat([torch.full((i + 1, 2), i, dtype=torch.int16) for i in range(n)]))
    assert torch.equal(got[1], torch.cat([torch.full((2,), i + 0.5) for i in range(n)]))
    root = n - 1
    got = plane.broadcast([torch.full((3,), float(r), dtype=torch.float64)], [None], root)[0]
    assert torch.equal(got, torch.full((3,), float(root), dtype=torch.float64))
    send = [i + 1 for i in range(n)]  # rank r sends i+1 rows to rank i
    out = plane.alltoall(torch.cat([torch.full((i + 1,), 10 * r + i) for i in range(n)]), send, [r + 1] * n)
    assert torch.equal(out, torch.cat([torch.full((r + 1,), 10 * i + r) for i in range(n)]))
    splits = [[2] + [1] * (n - 1)]
    mine = plane.reducescatter([torch.ones(n + 1, 2) * (r + 1)], "float32", hvd.Sum, 1.0, 1.0, splits)[0]
    assert torch.equal(mine, torch.full((splits[0][r], 2), float(sum(range(1, n + 1)))))
    # the whole engine path (negotiation, fusion, the plane executor) with the same buffers a CUDA tensor gives,
    # against the MPI path's results on the same CPU tensors
    def on_plane(t: torch.Tensor) -> PlaneBuffer:
        return PlaneBuffer("mpi_cuda", t, str(t.dtype).replace("torch.", ""), tuple(t.shape))
    xs = [torch.arange(6.0).reshape(2, 3) * (r + 1), torch.full((4,), float(r)), torch.arange(3.0) - r]
    got = core.grouped_allreduce([on_plane(x) for x in xs], op=hvd.Average, name="mpi_cuda.grouped")
    for g, want in zip(got, hvd.grouped_allreduce(xs, op=hvd.Average)):
        assert isinstance(g, torch.Tensor) and torch.equal(g, want)
    x = torch.full((r + 1, 2), r, dtype=torch.int64)
    assert torch.equal(core.allgather(on_plane(x), name="mpi_cuda.gather"), hvd.allgather(x))
    x = torch.arange(4.0) + r
    assert torch.equal(core.broadcast(on_plane(x), 1, name="mpi_cuda.bcast"), hvd.broadcast(x, 1))
    x, splits = torch.arange(float(sum(send))) + 100 * r, torch.tensor(send)
    out, recv = core.alltoall(on_plane(x), splits=np.array(send), name="mpi_cuda.a2a")
    want, want_splits = hvd.alltoall(x, splits)
    assert torch.equal(out, want) and list(recv) == want_splits.tolist()
    x = torch.arange(float(2 * n + 1)) * (r + 1)
    assert torch.equal(core.reducescatter(on_plane(x), op=hvd.Sum, name="mpi_cuda.rs"),
                       hvd.reducescatter(x, op=hvd.Sum))
