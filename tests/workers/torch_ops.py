"""Worker: every hvdlite.torch collective, dtype, handle, gradient, process set and helper, checked exactly.

Run by tests/test_torch_ops.py under ``mpiexec -n 2`` and ``-n 3``; prints "OK <check>" per passed group.
"""
import os
import sys
import tempfile
import time

import torch

import hvdlite.torch as hvd
import hvdlite.core as core

T0 = time.time()
hvd.init()
R, N = hvd.rank(), hvd.size()
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def ok(what):
    sys.stdout.write(f"OK {what} rank={R} t={time.time() - T0:.1f}\n")  # one write: lines never interleave
    sys.stdout.flush()


def base(r, shape=(3, 4), dtype=torch.float32):
    """Rank r's deterministic input: small integers, exact in every dtype."""
    g = torch.Generator().manual_seed(100 + r)
    return torch.randint(0, 5, shape, generator=g).to(dtype)


def same(a, b, what, tol=0.0):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert diff <= tol, f"{what}: max difference {diff} > {tol}\n{a}\n{b}"


# -- topology and build flags -------------------------------------------------------------------------
assert hvd.is_initialized() and 0 <= R < N and hvd.local_rank() < hvd.local_size()
assert hvd.cross_rank() < hvd.cross_size() and hvd.size() == core.size() and hvd.rank() == core.rank()
assert hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled() and not hvd.gloo_built()
assert isinstance(hvd.mpi_threads_supported(), bool)
assert [f() for f in (hvd.nccl_built, hvd.ddl_built, hvd.ccl_built, hvd.cuda_built, hvd.rocm_built)] == [False] * 5
ok("topology")

# -- allreduce: every dtype and op, exact -------------------------------------------------------------
inputs = {r: base(r) for r in range(N)}
for dtype in INTS + FLOATS:
    mine = inputs[R].to(dtype)
    stack = torch.stack([inputs[r].double() for r in range(N)])
    same(hvd.allreduce(mine, op=hvd.Sum), stack.sum(0).to(dtype), f"sum {dtype}")
    same(hvd.allreduce(mine, op=hvd.Min), stack.min(0).values.to(dtype), f"min {dtype}")
    same(hvd.allreduce(mine, op=hvd.Max), stack.max(0).values.to(dtype), f"max {dtype}")
    small = (inputs[R] % 2 + 1).to(dtype)  # products stay small
    prod = torch.stack([(inputs[r] % 2 + 1).double() for r in range(N)]).prod(0)
    same(hvd.allreduce(small, op=hvd.Product), prod.to(dtype), f"product {dtype}")
    if dtype in FLOATS:
        tol = 0.02 if dtype in (torch.float16, torch.bfloat16) else 1e-6
        same(hvd.allreduce(mine), (stack.sum(0) / N).to(dtype), f"average {dtype}", tol)
        same(hvd.allreduce(mine, average=True), (stack.sum(0) / N).to(dtype), f"average= {dtype}", tol)
        same(hvd.allreduce(mine, average=False), stack.sum(0).to(dtype), f"average=False {dtype}")
flags = (inputs[R] > 2)
all_flags = torch.stack([inputs[r] > 2 for r in range(N)])
same(hvd.allreduce(flags, op=hvd.Sum), all_flags.any(0), "bool or")
same(hvd.allreduce(flags, op=hvd.Min), all_flags.all(0), "bool and")
total = torch.stack([inputs[r] for r in range(N)]).sum(0)
same(hvd.allreduce(inputs[R], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), total, "pre/post scale")
same(hvd.allreduce(inputs[R].double(), op=hvd.Sum, postscale_factor=3.0), total.double() * 3, "postscale")
same(hvd.allreduce(inputs[R], compression=hvd.Compression.fp16, op=hvd.Sum), total, "fp16 compression")
same(hvd.allreduce(inputs[R], compression=hvd.Compression.bf16, op=hvd.Sum), total, "bf16 compression")
scalar = hvd.allreduce(torch.tensor(float(R)), op=hvd.Sum)
same(scalar, torch.tensor(float(sum(range(N)))), "0-dim")
ok("allreduce dtypes and ops")

# -- in place, zero copy, non-contiguous, async, grouped ----------------------------------------------
t = inputs[R].clone()
ptr = t.data_ptr()
out = hvd.allreduce_(t, op=hvd.Sum, name="inplace")
assert out is t and t.data_ptr() == ptr
same(t, total, "allreduce_")
for dtype in (torch.bfloat16, torch.float16, torch.int32):
    t = inputs[R].to(dtype)
    hvd.allreduce_(t, op=hvd.Sum)
    same(t, total.to(dtype), f"allreduce_ {dtype}")
wide = torch.stack([inputs[R], inputs[R] * 2], dim=2)  # (3, 4, 2)
view = wide[:, :, 1].t()  # non-contiguous view into wide
assert not view.is_contiguous()
same(hvd.allreduce(view, op=hvd.Sum), (total * 2).t(), "non-contiguous out of place")
hvd.allreduce_(view, op=hvd.Sum)
same(wide[:, :, 1], total * 2, "non-contiguous in place writes the view")
same(wide[:, :, 0], inputs[R], "non-contiguous in place leaves the rest")
bview = inputs[R].to(torch.bfloat16).t()
same(hvd.allreduce(bview, op=hvd.Sum), total.to(torch.bfloat16).t(), "bf16 non-contiguous")
h1 = hvd.allreduce_async(inputs[R], name="async.a", op=hvd.Sum)
t2 = inputs[R].clone()
h2 = hvd.allreduce_async_(t2, name="async.b", op=hvd.Max)
assert isinstance(hvd.poll(h1), bool)
same(hvd.synchronize(h1), total, "allreduce_async")
assert hvd.synchronize(h2) is t2 and hvd.poll(h2)
same(t2, torch.stack([inputs[r] for r in range(N)]).max(0).values, "allreduce_async_")
group = [inputs[R], inputs[R].double() * 2, inputs[R].to(torch.bfloat16)]
expect = [total, total.double() * 2, total.to(torch.bfloat16)]
for got, exp in zip(hvd.grouped_allreduce(group, op=hvd.Sum), expect):
    same(got, exp, "grouped_allreduce")
for got, exp in zip(hvd.synchronize(hvd.grouped_allreduce_async(group, op=hvd.Sum)), expect):
    same(got, exp, "grouped_allreduce_async")
copies = [g.clone() for g in group]
res = hvd.grouped_allreduce_(copies, op=hvd.Sum)
assert all(a is b for a, b in zip(res, copies))
for got, exp in zip(copies, expect):
    same(got, exp, "grouped_allreduce_")
copies = [g.clone() for g in group]
hvd.synchronize(hvd.grouped_allreduce_async_(copies, average=False))
for got, exp in zip(copies, expect):
    same(got, exp, "grouped_allreduce_async_")
ok("allreduce in place, async, grouped")

# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------------------
rows = {r: r + 1 for r in range(N)}
parts = {r: torch.full((rows[r], 2), float(r)) for r in range(N)}
for dtype in INTS + FLOATS + [torch.bool]:
    got = hvd.allgather(parts[R].to(dtype))
    same(got, torch.cat([parts[r] for r in range(N)]).to(dtype), f"allgather {dtype}")
same(hvd.synchronize(hvd.allgather_async(parts[R], name="ag")), torch.cat(list(parts.values())), "allgather_async")
g1, g2 = hvd.grouped_allgather([parts[R], parts[R][:, :1].t().contiguous().t()])
same(g1, torch.cat(list(parts.values())), "grouped_allgather 0")
same(g2, torch.cat(list(parts.values()))[:, :1], "grouped_allgather 1")
g1, = hvd.synchronize(hvd.grouped_allgather_async([parts[R].bfloat16()]))
same(g1, torch.cat(list(parts.values())).bfloat16(), "grouped_allgather_async")
same(hvd.allgather(torch.tensor(float(R))), torch.arange(N, dtype=torch.float32), "allgather 0-dim")
for root in range(N):
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        mine = inputs[R].to(dtype)
        same(hvd.broadcast(mine, root), inputs[root].to(dtype), f"broadcast {dtype} root {root}")
    t = inputs[R].clone().t()
    assert hvd.broadcast_(t, root) is t
    same(t, inputs[root].t(), "broadcast_ non-contiguous")
    t = inputs[R].clone()
    same(hvd.synchronize(hvd.broadcast_async(t, root)), inputs[root], "broadcast_async")
    same(t, inputs[R], "broadcast_async leaves its input")
    assert hvd.synchronize(hvd.broadcast_async_(t, root, name=f"b{root}")) is t
    same(t, inputs[root], "broadcast_async_")
send = torch.arange(N * 2, dtype=torch.float32) + 100 * R  # 2 rows to each rank
got = hvd.alltoall(send)
same(got, torch.cat([torch.arange(2 * R, 2 * R + 2, dtype=torch.float32) + 100 * r for r in range(N)]),
     "alltoall even")
splits = torch.tensor([r + 1 for r in range(N)], dtype=torch.int32)  # r+1 rows to rank r
send = torch.full((int(splits.sum()), 3), float(R)).bfloat16()
got, recv = hvd.alltoall(send, splits=splits)
same(recv, torch.full((N,), R + 1, dtype=torch.int32), "alltoall received splits")
same(got, torch.cat([torch.full((R + 1, 3), float(r)) for r in range(N)]).bfloat16(), "alltoall splits")
got, recv = hvd.synchronize(hvd.alltoall_async(send, splits=splits.tolist()))
assert recv.dtype == torch.int32 and got.shape == (N * (R + 1), 3)
big = torch.stack([inputs[R].flatten()] * N)  # (N, 12): row r goes to rank r after the reduction
whole = torch.stack([torch.stack([inputs[r].flatten()] * N) for r in range(N)])
same(hvd.reducescatter(big, op=hvd.Sum), whole.sum(0)[R:R + 1], "reducescatter sum")
same(hvd.reducescatter(big), whole.mean(0)[R:R + 1], "reducescatter average", 1e-6)
same(hvd.synchronize(hvd.reducescatter_async(big, op=hvd.Max)), whole.max(0).values[R:R + 1], "rs_async")
odd = torch.arange(2 * N + 1, dtype=torch.float64).reshape(-1, 1) * (R + 1)
lo = sum(2 + (1 if r < 1 else 0) for r in range(R))
mine_rows = 2 + (1 if R < 1 else 0)
scale = sum(range(1, N + 1))
same(hvd.reducescatter(odd, op=hvd.Sum), odd[lo:lo + mine_rows] / (R + 1) * scale, "reducescatter uneven")
a, b = hvd.grouped_reducescatter([big, big * 2], op=hvd.Sum)
same(a, whole.sum(0)[R:R + 1], "grouped_reducescatter 0")
same(b, whole.sum(0)[R:R + 1] * 2, "grouped_reducescatter 1")
a, = hvd.synchronize(hvd.grouped_reducescatter_async([big], op=hvd.Sum))
same(a, whole.sum(0)[R:R + 1], "grouped_reducescatter_async")
ok("allgather broadcast alltoall reducescatter")

# -- sparse -------------------------------------------------------------------------------------------
dense = torch.zeros(6, 2)
dense[R % 6] = R + 1
dense[(R + 2) % 6] += 1
sp = dense.to_sparse()
expect = sum((lambda d: (d.__setitem__(r % 6, r + 1), d.__setitem__((r + 2) % 6, d[(r + 2) % 6] + 1), d)[2])(
    torch.zeros(6, 2)) for r in range(N))
h = hvd.sparse_allreduce_async(sp, name="sparse", op=hvd.Sum)
res = hvd.synchronize(h)
assert res.is_sparse
same(res.to_dense(), expect, "sparse sum")
res = hvd.sparse_allreduce_async(sp, name="sparse2", op=hvd.Average)()
same(res.to_dense(), expect / N, "sparse average", 1e-6)
ok("sparse_allreduce_async")


# -- gradients: rank r's input gradient is d(sum of every rank's loss)/dx_r --------------------------
def weights(r, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(7 + r), dtype=torch.float64)


def check_grad(what, dist_fn, local_fn, shape=(4, 3), make=None):
    """dist_fn(x) runs the collective on this rank; local_fn(xs, r) simulates rank r's output."""
    make = make or (lambda r: torch.randn(shape, generator=torch.Generator().manual_seed(50 + r),
                                          dtype=torch.float64))
    x = make(R).requires_grad_()
    out = dist_fn(x)
    outs = out if isinstance(out, (list, tuple)) else [out]
    sum(((o * weights(R + 10 * i, o.shape)).sum() for i, o in enumerate(outs))).backward()
    xs = [make(r).requires_grad_() for r in range(N)]
    total = 0
    for r in range(N):
        sim = local_fn(xs, r)
        sims = sim if isinstance(sim, (list, tuple)) else [sim]
        total = total + sum((s * weights(r + 10 * i, s.shape)).sum() for i, s in enumerate(sims))
    total.backward()
    expected = xs[R].grad if xs[R].grad is not None else torch.zeros_like(xs[R])
    same(x.grad, expected, f"gradient of {what}", 1e-9)


stack = lambda xs: torch.stack(xs)
check_grad("allreduce sum", lambda x: hvd.allreduce(x, op=hvd.Sum), lambda xs, r: stack(xs).sum(0))
check_grad("allreduce average", lambda x: hvd.allreduce(x), lambda xs, r: stack(xs).mean(0))
check_grad("allreduce scaled", lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2, postscale_factor=3),
           lambda xs, r: stack(xs).sum(0) * 6)
check_grad("allreduce max", lambda x: hvd.allreduce(x, op=hvd.Max), lambda xs, r: stack(xs).max(0).values)
check_grad("allreduce min", lambda x: hvd.allreduce(x, op=hvd.Min), lambda xs, r: stack(xs).min(0).values)
check_grad("allreduce product", lambda x: hvd.allreduce(x, op=hvd.Product), lambda xs, r: stack(xs).prod(0))
check_grad("allreduce product with zeros", lambda x: hvd.allreduce(x, op=hvd.Product),
           lambda xs, r: stack(xs).prod(0),
           make=lambda r: torch.tensor([0.0, 2.0, 1.5 + r, 0.0 if r == 1 else 3.0], dtype=torch.float64))
check_grad("grouped_allreduce", lambda x: hvd.grouped_allreduce([x, x * 2], op=hvd.Sum),
           lambda xs, r: [stack(xs).sum(0), stack(xs).sum(0) * 2])
check_grad("allgather", lambda x: hvd.allgather(x), lambda xs, r: torch.cat(xs),
           make=lambda r: torch.randn(r + 1, 2, generator=torch.Generator().manual_seed(r), dtype=torch.float64))
check_grad("grouped_allgather", lambda x: hvd.grouped_allgather([x, x[:1] * 3]),
           lambda xs, r: [torch.cat(xs), torch.cat([x[:1] * 3 for x in xs])],
           make=lambda r: torch.randn(r + 1, 2, generator=torch.Generator().manual_seed(r), dtype=torch.float64))
for root in range(N):
    check_grad(f"broadcast root {root}", lambda x: hvd.broadcast(x, root), lambda xs, r: xs[root])
check_grad("alltoall", lambda x: hvd.alltoall(x), lambda xs, r: torch.cat([x[2 * r:2 * r + 2] for x in xs]),
           shape=(2 * N, 3))
sp_list = [r + 1 for r in range(N)]


def a2a_sim(xs, r):  # rank s sends rows [sum(sp[:r]), +sp[r]) of its input to rank r
    lo = sum(sp_list[:r])
    return torch.cat([x[lo:lo + sp_list[r]] for x in xs])


check_grad("alltoall splits", lambda x: hvd.alltoall(x, splits=sp_list)[0], a2a_sim, shape=(sum(sp_list), 2))
check_grad("reducescatter sum", lambda x: hvd.reducescatter(x, op=hvd.Sum),
           lambda xs, r: stack(xs).sum(0)[2 * r:2 * r + 2], shape=(2 * N, 3))
check_grad("reducescatter average", lambda x: hvd.reducescatter(x),
           lambda xs, r: stack(xs).mean(0)[2 * r:2 * r + 2], shape=(2 * N, 3))
check_grad("grouped_reducescatter", lambda x: hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum),
           lambda xs, r: [stack(xs).sum(0)[2 * r:2 * r + 2], stack(xs).sum(0)[2 * r:2 * r + 2] * 2],
           shape=(2 * N, 3))
ok("gradients")

# -- process sets, objects, barrier, join, timeline, errors -------------------------------------------
members = [0, N - 1] if N > 2 else [1]
edge = hvd.add_process_set(members)
assert isinstance(edge, hvd.ProcessSet) and edge.size() == len(members)
if edge.included():
    got = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=edge)
    same(got, torch.tensor([float(sum(members))]), "process set allreduce")
    same(hvd.allgather(torch.tensor([R]), process_set=edge), torch.tensor(members), "process set allgather")
    root = len(members) - 1  # relative to the set
    same(hvd.broadcast(torch.tensor([R]), root, process_set=edge), torch.tensor([members[root]]), "set root")
    assert hvd.broadcast_object({"r": R}, root_rank=root, process_set=edge) == {"r": members[root]}
    hvd.barrier(process_set=edge)
else:
    assert edge.rank() == -1
hvd.barrier()
assert hvd.remove_process_set(edge)
assert hvd.global_process_set.size() == N
assert hvd.broadcast_object({"from": R, "t": torch.ones(2) * R}, root_rank=N - 1)["from"] == N - 1
assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
assert hvd.join() in range(N)
timeline = os.path.join(tempfile.gettempdir(), f"hvdlite_torch_timeline_{os.getpid()}.json")
timeline = hvd.broadcast_object(timeline, 0)
hvd.start_timeline(timeline)
hvd.allreduce(torch.ones(3), name="timeline.op")
hvd.stop_timeline()
if R == 0:
    text = open(timeline).read()
    assert "timeline.op" in text, text[:500]
    os.remove(timeline)
assert hvd.HorovodInternalError is hvd.HvdliteError and issubclass(hvd.HorovodInternalError, RuntimeError)
try:
    hvd.allreduce(torch.ones(R + 1), name="mismatch")
    raise AssertionError("a shape mismatch did not raise")
except hvd.HorovodInternalError as exc:
    assert "mismatch" in str(exc), exc
try:
    hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    raise AssertionError("Adasum did not raise")
except NotImplementedError as exc:
    assert "Adasum" in str(exc)
try:
    hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    raise AssertionError("complex did not raise")
except TypeError as exc:
    assert "complex64" in str(exc)
ok("process sets, objects, join, timeline, errors")
hvd.shutdown()
sys.stdout.write(f"DONE rank={R}\n")
sys.stdout.flush()
