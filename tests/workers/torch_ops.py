"""Worker: every hvdlite.torch collective, dtype, handle, gradient, process set and helper, checked exactly.

Run (via torch_all.py) by tests/test_torch_mpi.py under ``mpiexec -n 2`` and ``-n 3``; prints
"OK <check>" per passed group.
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


# -- gradients: Horovod's backward conventions, with exact expected values ---------------------------
# Rank r backpropagates sum_k(out_k * up(r, out_k.shape, k)), so up(r, ...) is the upstream gradient of
# its k-th output; every expected input gradient below is Horovod's formula applied to all ranks' up().
def up(r, shape, k=0):
    """Rank r's upstream gradient for output k: integers 1..4 (positive, so sums never cancel to 0)."""
    return torch.randint(1, 5, shape, generator=torch.Generator().manual_seed(1000 + 10 * r + k)).double()


def ups(shape, k=0, ranks=None):
    """Every rank's (or ``ranks``') upstream gradient, stacked along a new dimension 0."""
    return torch.stack([up(r, shape, k) for r in (range(N) if ranks is None else ranks)])


def grad_of(fn, x):
    """This rank's input gradient through the collective(s) in ``fn``."""
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    sum((o * up(R, o.shape, k)).sum() for k, o in enumerate(outs)).backward()
    return x.grad


def check(what, fn, x, expected):
    """Exact up to float64 rounding of the division by the set size (the old conventions differ by >= 1/3)."""
    same(grad_of(fn, x), expected, f"gradient of {what}", tol=1e-12)


x = torch.randn(4, 3, generator=torch.Generator().manual_seed(50 + R), dtype=torch.float64)
U = ups((4, 3))
# allreduce: an allreduce of the upstream gradients with the forward's op, scale factors and set
check("allreduce Sum", lambda v: hvd.allreduce(v, op=hvd.Sum), x, U.sum(0))
check("allreduce Average", lambda v: hvd.allreduce(v), x, U.sum(0) / N)
check("allreduce average=False", lambda v: hvd.allreduce(v, average=False), x, U.sum(0))
check("allreduce scaled", lambda v: hvd.allreduce(v, op=hvd.Sum, prescale_factor=2, postscale_factor=3), x,
      6 * U.sum(0))
check("allreduce Min", lambda v: hvd.allreduce(v, op=hvd.Min), x, U.min(0).values)
check("allreduce Max scaled", lambda v: hvd.allreduce(v, op=hvd.Max, prescale_factor=2, postscale_factor=3), x,
      6 * U.max(0).values)
check("allreduce Product", lambda v: hvd.allreduce(v, op=hvd.Product), x, U.prod(0))
check("allreduce fp16 compression", lambda v: hvd.allreduce(v, op=hvd.Sum, compression=hvd.Compression.fp16),
      x, U.sum(0))
U1 = ups((4, 3), k=1)
check("grouped_allreduce Sum", lambda v: hvd.grouped_allreduce([v, v * 2], op=hvd.Sum), x,
      U.sum(0) + 2 * U1.sum(0))
check("grouped_allreduce Min", lambda v: hvd.grouped_allreduce([v, v * 2], op=hvd.Min, postscale_factor=2), x,
      2 * U.min(0).values + 4 * U1.min(0).values)
check("grouped_allreduce Product", lambda v: hvd.grouped_allreduce([v, v * 2], op=hvd.Product), x,
      U.prod(0) + 2 * U1.prod(0))
# allgather: the upstream gradients averaged over the set, this rank's rows (rank r has r + 1 rows)
rows_total = N * (N + 1) // 2
first = R * (R + 1) // 2
mine = torch.randn(R + 1, 2, generator=torch.Generator().manual_seed(R), dtype=torch.float64)
G = ups((rows_total, 2))
check("allgather", lambda v: hvd.allgather(v), mine, (G.sum(0) / N)[first:first + R + 1])
expect = (G.sum(0) / N)[first:first + R + 1].clone()
expect[0] += 3 * (ups((N, 2), k=1).sum(0) / N)[R]
check("grouped_allgather", lambda v: hvd.grouped_allgather([v, v[:1] * 3]), mine, expect)
check("allgather 0-dim", lambda v: hvd.allgather(v), torch.tensor(1.5, dtype=torch.float64),
      (ups((N,)).sum(0) / N)[R])
# broadcast: the set's average upstream gradient on the root, zeros elsewhere
for root in range(N):
    check(f"broadcast root {root}", lambda v: hvd.broadcast(v, root), x,
          U.sum(0) / N if R == root else torch.zeros(4, 3, dtype=torch.float64))
# alltoall: rank R's input rows sent to rank d come back with d's upstream gradient for them
send = torch.randn(2 * N, 3, generator=torch.Generator().manual_seed(60 + R), dtype=torch.float64)
check("alltoall", lambda v: hvd.alltoall(v), send,
      torch.cat([up(d, (2 * N, 3))[2 * R:2 * R + 2] for d in range(N)]))
sp_list = [r + 1 for r in range(N)]  # d + 1 rows to rank d, whose output has N * (d + 1) rows
check("alltoall splits", lambda v: hvd.alltoall(v, splits=sp_list)[0],
      torch.randn(sum(sp_list), 2, generator=torch.Generator().manual_seed(70 + R), dtype=torch.float64),
      torch.cat([up(d, (N * (d + 1), 2))[R * (d + 1):(R + 1) * (d + 1)] for d in range(N)]))
# reducescatter: an allgather of the upstream gradients, times the set size for Sum and the scale factors
big = torch.randn(2 * N, 3, generator=torch.Generator().manual_seed(80 + R), dtype=torch.float64)
S0, S1 = torch.cat(list(ups((2, 3)))), torch.cat(list(ups((2, 3), k=1)))
check("reducescatter Sum", lambda v: hvd.reducescatter(v, op=hvd.Sum), big, N * S0)
check("reducescatter Average", lambda v: hvd.reducescatter(v), big, S0)
check("reducescatter Sum scaled",
      lambda v: hvd.reducescatter(v, op=hvd.Sum, prescale_factor=2, postscale_factor=3), big, 6 * N * S0)
check("reducescatter Average scaled", lambda v: hvd.reducescatter(v, prescale_factor=0.5), big, 0.5 * S0)
check("reducescatter Max", lambda v: hvd.reducescatter(v, op=hvd.Max), big, S0)
check("grouped_reducescatter Sum", lambda v: hvd.grouped_reducescatter([v, v * 2], op=hvd.Sum), big,
      N * S0 + 2 * N * S1)
check("grouped_reducescatter Average", lambda v: hvd.grouped_reducescatter([v, v * 2]), big, S0 + 2 * S1)
# the same rules over a process set without rank 0, so set ranks differ from global ones
grad_members = list(range(1, N))  # set rank = global rank - 1
grad_set = hvd.add_process_set(grad_members)
if grad_set.included():
    M, me = len(grad_members), grad_set.rank()
    US = ups((4, 3), ranks=grad_members)
    check("set allreduce Sum", lambda v: hvd.allreduce(v, op=hvd.Sum, process_set=grad_set), x, US.sum(0))
    check("set allreduce Average", lambda v: hvd.allreduce(v, process_set=grad_set), x, US.sum(0) / M)
    check("set allreduce Max", lambda v: hvd.allreduce(v, op=hvd.Max, process_set=grad_set), x,
          US.max(0).values)
    ranged = torch.randn(me + 1, 2, generator=torch.Generator().manual_seed(90 + R), dtype=torch.float64)
    GS = ups((M * (M + 1) // 2, 2), ranks=grad_members)
    check("set allgather", lambda v: hvd.allgather(v, process_set=grad_set), ranged,
          (GS.sum(0) / M)[me * (me + 1) // 2:me * (me + 1) // 2 + me + 1])
    for root in range(M):  # root_rank is relative to the set
        check(f"set broadcast root {root}", lambda v: hvd.broadcast(v, root, process_set=grad_set), x,
              US.sum(0) / M if me == root else torch.zeros(4, 3, dtype=torch.float64))
    check("set reducescatter Sum", lambda v: hvd.reducescatter(v, op=hvd.Sum, process_set=grad_set),
          big[:2 * M], M * torch.cat(list(ups((2, 3), ranks=grad_members))))
hvd.barrier()
assert hvd.remove_process_set(grad_set)
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
if N & (N - 1):  # Adasum needs a power-of-two set (tests/parallel/test_torch_adasum.py checks its values)
    try:
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
        raise AssertionError("Adasum on a set that is not a power of two did not raise")
    except ValueError as exc:
        assert "power-of-two" in str(exc), exc
else:
    same(hvd.allreduce(torch.ones(2), op=hvd.Adasum), torch.ones(2), "Adasum of identical tensors")
try:
    hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    raise AssertionError("complex did not raise")
except TypeError as exc:
    assert "complex64" in str(exc)
ok("process sets, objects, join, timeline, errors")
hvd.shutdown()
sys.stdout.write(f"DONE rank={R}\n")
sys.stdout.flush()
