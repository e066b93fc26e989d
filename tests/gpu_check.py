"""Every torch collective on the rank's device against the same collective on CPU tensors over hvdlite's MPI
path (exact equality), DistributedOptimizer on the device against single-process training, the same again on
CUDA-aware MPI where the MPI library is CUDA-aware, and the device errors. Run under mpiexec
(python tests/gpu_check.py); prints one JSON line per rank; exits 1 on a failure. A check that cannot run
here says "skipped: <why>". On a machine without CUDA it runs on CPU tensors (useful with
HOROVOD_CPU_OPERATIONS=GLOO: gloo vs MPI).

``python tests/gpu_check.py --nccl-missing`` (under mpiexec, -n 2 or more) checks the "CUDA tensor with NCCL
unavailable" cases instead: the last rank hides its GPUs (CUDA_VISIBLE_DEVICES=""), so NCCL is not available on
every rank; rank 0's CUDA tensors then go through host staging (or CUDA-aware MPI), and with
HOROVOD_GPU_OPERATIONS=NCCL they raise the error naming the fix.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

NCCL_MISSING = "--nccl-missing" in sys.argv[1:]
if NCCL_MISSING:  # before torch is imported: the last rank of the job sees no GPU
    _rank, _size = (int(next((os.environ[v] for v in names if v in os.environ), default)) for names, default in (
        (("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"), "0"),
        (("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"), "1")))
    if _size > 1 and _rank == _size - 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.torch import tensors  # noqa: E402
from hvdlite.torch.plane import FACTORY  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
CUDA = torch.cuda.is_available()
if CUDA:
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
DEV = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
results: dict = {"rank": R, "size": N, "device": str(DEV), "checks": {}, "failures": []}


def inputs(r: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + r)
    return torch.randint(0, 5, shape, generator=g).to(dtype)


def check(name: str, fn) -> None:
    """Run one check; it returns None when it passed, or "skipped: <why>" when it cannot run here."""
    try:
        skipped = fn()
        results["checks"][name] = skipped or "ok"
        if skipped:
            print(f"rank {R}: {name}: {skipped}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - report every failure, keep going
        results["checks"][name] = f"FAILED: {type(exc).__name__}: {exc}"
        results["failures"].append(name + "\n" + traceback.format_exc())


def same(dev_result, cpu_result, what: str) -> None:
    a = dev_result.cpu() if isinstance(dev_result, torch.Tensor) else dev_result
    assert a.dtype == cpu_result.dtype and a.shape == cpu_result.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs " \
        f"{cpu_result.dtype}{tuple(cpu_result.shape)}"
    assert torch.equal(a, cpu_result), f"{what}: device result differs from the MPI result\n{a}\n{cpu_result}"


DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def allreduce_all() -> None:
    for dtype in DTYPES:
        for op in OPS:
            x = inputs(R, (3, 5), dtype)
            pre, post = (1.0, 1.0) if dtype in (torch.uint8,) else (0.5, 3.0)
            cpu = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post, name=f"c.{dtype}.{op}")
            dev = hvd.allreduce(x.to(DEV), op=op, prescale_factor=pre, postscale_factor=post,
                                name=f"d.{dtype}.{op}")
            assert dev.device == DEV, dev.device
            same(dev, cpu, f"allreduce {dtype} {op}")
    b = torch.tensor([R == 0, True, False])
    same(hvd.allreduce(b.to(DEV), op=hvd.Sum), hvd.allreduce(b, op=hvd.Sum), "bool or")


def grouped_and_inplace() -> None:
    xs = [inputs(R, (i + 1, 3), torch.float32) for i in range(4)]
    cpu = hvd.grouped_allreduce(xs, op=hvd.Average)
    dev = hvd.grouped_allreduce([x.to(DEV) for x in xs], op=hvd.Average)
    for d, c in zip(dev, cpu):
        same(d, c, "grouped allreduce")
    ys = [x.to(DEV, copy=True) for x in xs]
    hvd.grouped_allreduce_(ys, op=hvd.Sum)
    for y, c in zip(ys, hvd.grouped_allreduce(xs, op=hvd.Sum)):
        same(y, c, "grouped allreduce_ (in place)")
    z = xs[0].to(DEV, copy=True).t()  # not contiguous: reduced in a copy, written back
    hvd.allreduce_(z, op=hvd.Sum)
    same(z, hvd.allreduce(xs[0].t().contiguous(), op=hvd.Sum), "allreduce_ of a transposed tensor")


def allgather_uneven() -> None:
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        x = inputs(R, (R + 1, 2, 3), dtype)
        same(hvd.allgather(x.to(DEV)), hvd.allgather(x), f"allgather {dtype}")
    xs = [inputs(R, (R + 2,), torch.float32), inputs(R, (1, 4), torch.int32)]
    for d, c in zip(hvd.grouped_allgather([x.to(DEV) for x in xs]), hvd.grouped_allgather(xs)):
        same(d, c, "grouped allgather")


def broadcast_all() -> None:
    for root in range(N):
        x = inputs(R, (4, 2), torch.float32)
        same(hvd.broadcast(x.to(DEV), root), hvd.broadcast(x, root), f"broadcast root {root}")
        y = x.to(DEV, copy=True)
        hvd.broadcast_(y, root)
        same(y, hvd.broadcast(x, root), f"broadcast_ root {root}")


def alltoall_splits() -> None:
    splits = torch.tensor([(R + r) % 3 for r in range(N)], dtype=torch.int32)
    x = inputs(R, (int(splits.sum()), 2), torch.float32)
    (dev, dev_splits), (cpu, cpu_splits) = hvd.alltoall(x.to(DEV), splits), hvd.alltoall(x, splits)
    same(dev, cpu, "alltoall with splits")
    assert torch.equal(dev_splits, cpu_splits)


def reducescatter_all() -> None:
    for rows in (N * 2, N * 2 + 1):
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            x = inputs(R, (rows, 3), torch.float32)
            same(hvd.reducescatter(x.to(DEV), op=op), hvd.reducescatter(x, op=op), f"reducescatter {rows} {op}")
    xs = [inputs(R, (N + 1, 2), torch.float32), inputs(R, (N, 3), torch.float32)]
    for d, c in zip(hvd.grouped_reducescatter([x.to(DEV) for x in xs], op=hvd.Sum),
                    hvd.grouped_reducescatter(xs, op=hvd.Sum)):
        same(d, c, "grouped reducescatter")


def process_sets() -> str | None:
    if N < 2:
        return "skipped: needs 2 or more ranks"
    members = [0, 1] if N > 2 else [1]
    ps = hvd.add_process_set(members)
    try:
        if R in members:
            x = inputs(R, (5,), torch.float32)
            same(hvd.allreduce(x.to(DEV), op=hvd.Sum, process_set=ps), hvd.allreduce(x, op=hvd.Sum, process_set=ps),
                 "allreduce on a process set")
    finally:
        hvd.remove_process_set(ps)
    return None


def sparse() -> None:
    idx = torch.tensor([[R % 3, 1]])
    sp = torch.sparse_coo_tensor(idx.t(), torch.tensor([1.0 + R]), (4, 2))
    dev = hvd.sparse_allreduce_async(sp.to(DEV), "sp.d", hvd.Sum)()
    cpu = hvd.sparse_allreduce_async(sp, "sp.c", hvd.Sum)()
    same(dev.to_dense(), cpu.to_dense(), "sparse allreduce")


def accumulating_compression() -> None:
    """bf16/fp16 on the wire, float32 sums (issue 35) on the device: the plane's all-to-all and all-gather (NCCL,
    gloo or host staging) give the bits of the same op on CPU tensors over MPI, which the suite checks against
    the float32 rank-order reference (tests/parallel/test_fp32_accumulation.py)."""
    comps = (hvd.Compression.bf16_fp32acc, hvd.Compression.fp16_fp32acc, hvd.Compression.bf16_fp32acc_fp32gather)
    for comp in comps:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for op, pre, post in ((hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0)):
                gen = torch.Generator().manual_seed(11 + R)
                x = (torch.randn(37, 3, generator=gen) * 10.0 ** torch.randint(-2, 3, (37, 3), generator=gen)
                     ).to(dtype)  # random magnitudes: every sum is rounded
                kw = dict(op=op, prescale_factor=pre, postscale_factor=post, compression=comp)
                what = f"{comp.__name__} {dtype} {op}"
                same(hvd.allreduce(x.to(DEV), **kw), hvd.allreduce(x, **kw), f"allreduce {what}")
        xs = [inputs(R, (5,), torch.float32) / 3, inputs(R, (3, 2), torch.bfloat16), inputs(R, (4,), torch.int32)]
        cpu = hvd.grouped_allreduce(xs, op=hvd.Average, compression=comp)
        for d, c in zip(hvd.grouped_allreduce([x.to(DEV) for x in xs], op=hvd.Average, compression=comp), cpu):
            same(d, c, f"grouped allreduce of mixed dtypes, {comp.__name__}")


def optimizer_equivalence(zero: bool = False) -> None:
    """DistributedOptimizer (or ZeroRedundancyOptimizer) on the device equals one process training on every
    rank's batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference.load_state_dict(model.state_dict())
    model.to(DEV)
    reference.to(DEV)
    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if zero else \
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(4):
        batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + r)).double()
                   for r in range(N)]
        targets = [b.sum(1, keepdim=True).repeat(1, 2) for b in batches]
        opt.zero_grad()
        nn.functional.mse_loss(model(batches[R].to(DEV)), targets[R].to(DEV)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(nn.functional.mse_loss(reference(b.to(DEV)), t.to(DEV)) for b, t in zip(batches, targets)) / N
        loss.backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        diff = (p - q).abs().max().item()
        assert diff < 1e-12, f"weights differ from single-process training by {diff}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    same(hvd.broadcast(flat, 0), flat, "identical weights on every rank")


def sync_batch_norm() -> None:
    """SyncBatchNorm on the device: output and input gradient equal the CPU (MPI path) ones."""
    outs = []
    for dev in (DEV, torch.device("cpu")):
        torch.manual_seed(1)
        bn = hvd.SyncBatchNorm(3).double().to(dev)
        x = (torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(50 + R)).double() * (R + 1)).to(dev)
        x.requires_grad_(True)
        y = bn(x)
        (y * torch.arange(5.0, device=dev).double()).sum().backward()
        outs.append((y.detach().cpu(), x.grad.cpu(), bn.running_mean.cpu()))
    for a, b, what in zip(outs[0], outs[1], ("output", "input gradient", "running mean")):
        diff = (a - b).abs().max().item()
        assert diff < 1e-10, f"SyncBatchNorm {what}: device and CPU differ by {diff}"


def mixed_devices_error() -> str | None:
    if not CUDA:
        return "skipped: no CUDA device"
    try:
        hvd.grouped_allreduce([torch.ones(2), torch.ones(2, device=DEV)])
    except ValueError as exc:
        assert "one device" in str(exc), exc
    else:
        raise AssertionError("a grouped op of CPU and GPU tensors was accepted")
    return None


def plane_of_allreduce(t: torch.Tensor) -> str:
    return getattr(tensors.to_host(t, "allreduce")[0], "plane", "")


def cuda_aware_mpi() -> str | None:
    """The collectives and DistributedOptimizer again with HOROVOD_GPU_OPERATIONS=MPI, on CUDA-aware MPI."""
    aware, how = FACTORY.mpi_cuda
    results["mpi_cuda_aware"] = [aware, how]
    everyone = hvd.allgather_object((aware, CUDA, how))  # every rank decides alike (init() below is collective)
    if not aware:
        return f"skipped: MPI not CUDA-aware ({how})"
    if not all(a for a, _, _ in everyone):
        return f"skipped: MPI not CUDA-aware on every rank ({[h for a, _, h in everyone if not a]})"
    if not all(c for _, c, _ in everyone):
        return "skipped: no CUDA device on every rank"
    hvd.shutdown()
    hvd.init(gpu_operations="MPI")
    try:
        plane = plane_of_allreduce(torch.ones(2, device=DEV))
        assert plane == "mpi_cuda", f"CUDA-aware MPI here, but a CUDA allreduce takes {plane or 'host staging'!r}: " \
            f"{tensors.mpi_cuda_missing()}"
        for fn in (allreduce_all, grouped_and_inplace, allgather_uneven, broadcast_all, alltoall_splits,
                   reducescatter_all, process_sets, optimizer_equivalence):
            fn()
    finally:
        hvd.shutdown()
        hvd.init()
    return None


def other_device_error() -> str | None:
    """A CUDA tensor on another GPU than the rank's own (the current device) is refused, naming the fix."""
    gpus = min(hvd.allgather_object(torch.cuda.device_count() if CUDA else 0))  # every rank decides alike
    if gpus < 2:
        return f"skipped: needs 2 or more GPUs per rank's node (the job's smallest node has {gpus})"
    if plane_of_allreduce(torch.ones(2, device=DEV)) != "nccl":
        return "skipped: the check is NCCL's (the job's CUDA allreduce does not take NCCL here)"
    other = torch.device("cuda", (DEV.index + 1) % torch.cuda.device_count())
    try:
        hvd.allreduce(torch.ones(2, device=other), name="other.device")
    except RuntimeError as exc:
        assert f"this rank's GPU is cuda:{DEV.index}" in str(exc) and "torch.cuda.set_device" in str(exc), exc
    else:
        raise AssertionError(f"an allreduce of a tensor on {other} was accepted on a rank whose GPU is {DEV}")
    return None


def nccl_missing() -> str | None:
    """Rank 0 has a GPU, the last rank none: NCCL is not agreed; CUDA tensors fall back (same results as
    the CPU path), and NCCL asked for by name is an error naming the fix (raised on submission, locally)."""
    if N < 2:
        return "skipped: needs 2 or more ranks (the last one hides its GPUs)"
    if not hvd.broadcast_object(CUDA, root_rank=0):  # every rank skips alike
        return "skipped: rank 0 has no CUDA device"
    assert not tensors.plane_agreed("nccl"), "NCCL is agreed although the last rank has no GPU"
    x = inputs(R, (3, 4), torch.float32)
    mine = x.to(DEV) if R == 0 else x
    fallback = plane_of_allreduce(mine) if R == 0 else ""
    assert fallback in ("", "mpi_cuda"), fallback
    same(hvd.allreduce(mine, op=hvd.Sum, name="nccl.missing"), hvd.allreduce(x, op=hvd.Sum, name="cpu.ref"),
         "allreduce with NCCL missing")
    hvd.shutdown()
    hvd.init(gpu_operations="NCCL")
    try:
        if R == 0:
            try:
                hvd.allreduce(torch.ones(2, device=DEV), name="nccl.asked")
            except RuntimeError as exc:
                assert "asks for NCCL, but NCCL is not available on every rank" in str(exc), exc
                assert "set it to MPI" in str(exc), exc
            else:
                raise AssertionError("HOROVOD_GPU_OPERATIONS=NCCL with NCCL missing on a rank was accepted")
        hvd.barrier()
    finally:
        hvd.shutdown()
        hvd.init()
    results["nccl_missing_fallback_plane"] = fallback or "mpi (host staging)"
    return None


def nccl_abandoned_then_made_again() -> str | None:
    """What in-process recovery does to the NCCL plane after a lost rank (core/recovery.py: the old runtime's
    ``abandon()``, then a new runtime): the old communicator is aborted (TorchPlane.abandon: ncclCommAbort through
    c10d, within ABORT_WAIT_S), the next init() makes a new one in the same process, and collectives through it
    are exact. (No peer can die here with one GPU per rank and one GPU: the abort of a communicator with a
    collective hung on a dead peer needs two GPUs.)"""
    if plane_of_allreduce(torch.ones(2, device=DEV)) != "nccl":
        return "skipped: the check is NCCL's (the job's CUDA allreduce does not take NCCL here)"
    import time

    from hvdlite.core import runtime
    from hvdlite.torch.plane import ABORT_WAIT_S
    x = inputs(R, (3, 5), torch.float32)
    same(hvd.allreduce(x.to(DEV), op=hvd.Sum, name="before.abort"), hvd.allreduce(x, op=hvd.Sum, name="cpu.a"),
         "allreduce before the abort")
    state = runtime.state()
    old = state.planes.plane("nccl", 0)
    assert callable(getattr(old.group, "abort", None)), f"{type(old.group).__name__} has no abort() in this torch"
    started = time.monotonic()
    state.planes.close(clean=False)  # what State.abandon() does to the planes after a lost rank
    took = time.monotonic() - started
    assert took < ABORT_WAIT_S, f"the NCCL abort took {took:.1f} s (the recovery would have gone on without it)"
    results["nccl_abort_seconds"] = round(took, 4)
    hvd.shutdown()
    hvd.init()
    new = runtime.state().planes.plane("nccl", 0)
    assert new is not old and new.group is not old.group
    for step in range(3):
        y = inputs(R + step, (4, 3), torch.float32)
        same(hvd.allreduce(y.to(DEV), op=hvd.Sum, name=f"after.abort.{step}"),
             hvd.allreduce(y, op=hvd.Sum, name=f"cpu.b.{step}"), "allreduce through the new NCCL communicator")
    assert plane_of_allreduce(torch.ones(2, device=DEV)) == "nccl"
    return None


CHECKS = [("allreduce every dtype and op", allreduce_all), ("grouped and in place", grouped_and_inplace),
          ("allgather uneven", allgather_uneven), ("broadcast", broadcast_all),
          ("alltoall splits", alltoall_splits), ("reducescatter", reducescatter_all),
          ("process sets", process_sets), ("sparse", sparse),
          ("accumulating compression", accumulating_compression),
          ("optimizer equivalence", optimizer_equivalence),
          ("zero optimizer equivalence", lambda: optimizer_equivalence(zero=True)),
          ("sync batch norm", sync_batch_norm), ("mixed devices error", mixed_devices_error),
          ("cuda-aware MPI", cuda_aware_mpi), ("other device error", other_device_error),
          ("NCCL plane abandoned, then made again", nccl_abandoned_then_made_again)]
for name, fn in [("CUDA tensor with NCCL unavailable", nccl_missing)] if NCCL_MISSING else CHECKS:
    check(name, fn)
results["plane_of_a_device_allreduce"] = plane_of_allreduce(torch.ones(2, device=DEV)) \
    or "mpi (host staging)" if CUDA else plane_of_allreduce(torch.ones(2)) or "mpi"
results["planes"] = {"gloo_enabled": hvd.gloo_enabled(), "nccl_built": hvd.nccl_built(),
                     "cuda_built": hvd.cuda_built()}
sys.stdout.write(json.dumps(results) + "\n")  # one write: print's two (the line, then its end) interleave with
sys.stdout.flush()  # the other ranks' under PYTHONUNBUFFERED
hvd.shutdown()
sys.exit(1 if results["failures"] else 0)
