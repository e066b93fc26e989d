"""Every collective, dtype and reduce op against numpy-computed expectations, at any size."""
import numpy as np

import hvdlite as hvd
from _check import raises, same

hvd.init()
r, n = hvd.rank(), hvd.size()

INTS = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"]
FLOATS = ["float16", "float32", "float64"]


def value(rank, dtype, shape=(2, 3), lo=1, hi=4):
    data = (np.arange(int(np.prod(shape))).reshape(shape) + 3 * rank) % (hi - lo) + lo
    return data.astype(dtype)


every = lambda dtype, **kw: np.stack([value(k, dtype, **kw) for k in range(n)])

# allreduce: every dtype x op, against numpy
for dtype in INTS + FLOATS:
    for op, reduce in [(hvd.Sum, np.sum), (hvd.Min, np.min), (hvd.Max, np.max), (hvd.Product, np.prod)]:
        got = hvd.allreduce(value(r, dtype), op=op, name=f"ar.{dtype}.{op.value}")
        same(got, reduce(every(dtype), axis=0).astype(dtype), f"allreduce {dtype} {op}", r)
    if dtype in FLOATS:
        got = hvd.allreduce(value(r, dtype), name=f"avg.{dtype}")
        same(got, (every(dtype).astype(np.float64).sum(0) / n).astype(dtype), f"average {dtype}", r)
    else:  # integer average truncates toward zero
        got = hvd.allreduce(value(r, dtype), op=hvd.Average, name=f"avg.{dtype}")
        same(got, np.trunc(every(dtype).astype(np.float64).sum(0) / n).astype(dtype), f"average {dtype}", r)

# bool: Sum/Max are logical or, Min/Product logical and; Average is an error
flags = np.array([r == 0, True, False, r % 2 == 1])
all_flags = np.stack([np.array([k == 0, True, False, k % 2 == 1]) for k in range(n)])
same(hvd.allreduce(flags, op=hvd.Sum), all_flags.any(0), "bool sum", r)
same(hvd.allreduce(flags, op=hvd.Max), all_flags.any(0), "bool max", r)
same(hvd.allreduce(flags, op=hvd.Min), all_flags.all(0), "bool min", r)
same(hvd.allreduce(flags, op=hvd.Product), all_flags.all(0), "bool product", r)
raises(TypeError, lambda: hvd.allreduce(flags), "not defined for bool")

# bfloat16 travels as uint16 bits with a dtype hint
bf = (np.array([1.0, 2.5, -3.0], dtype=np.float32) * (r + 1)).view(np.uint32) >> 16
got = hvd.allreduce_async(bf.astype(np.uint16), op=hvd.Sum, dtype_hint="bfloat16").wait()
got_f32 = (got.astype(np.uint32) << 16).view(np.float32)
same(got_f32, np.array([1.0, 2.5, -3.0], np.float32) * sum(range(1, n + 1)), "bfloat16 sum", r)

# prescale / postscale, average= (Horovod's old argument), in place, non-contiguous, empty, 0-d
x = np.full(5, r + 1, dtype=np.float64)
same(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
     np.full(5, float(sum(range(1, n + 1)))), "pre/postscale", r)
same(hvd.allreduce(x, average=False), np.full(5, float(sum(range(1, n + 1)))), "average=False", r)
same(hvd.allreduce(x, average=True), np.full(5, sum(range(1, n + 1)) / n), "average=True", r)
y = np.full(4, float(r))
out = hvd.allreduce_(y, op=hvd.Sum)
assert out is y, "allreduce_ returns the same array"
same(y, np.full(4, float(sum(range(n)))), "allreduce_ in place", r)
big = np.arange(24, dtype=np.float32).reshape(4, 6) + r
view = big[:, ::2]  # non-contiguous
hvd.allreduce_(view, op=hvd.Sum)
same(big[:, ::2], (np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2] * n + sum(range(n))), "non-contig", r)
same(big[:, 1::2], np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1::2] + r, "non-contig untouched", r)
same(hvd.allreduce(np.zeros((0, 3), np.float32)), np.zeros((0, 3), np.float32), "empty", r)
same(hvd.allreduce(np.float64(r), op=hvd.Sum), np.float64(sum(range(n))), "0-d", r)
h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="async.one")
assert isinstance(hvd.poll(h), bool)
same(hvd.synchronize(h), np.full(3, float(n)), "async", r)

# in-place and out-of-place small tensors fused in one cycle
mixed_in = [np.full(3, float(r)) for _ in range(4)]
handles = [hvd.allreduce_async_(a, op=hvd.Sum, name=f"mixed.in.{i}") if i % 2 else
           hvd.allreduce_async(a, op=hvd.Sum, name=f"mixed.out.{i}") for i, a in enumerate(mixed_in)]
for i, h in enumerate(handles):
    same(hvd.synchronize(h), np.full(3, float(sum(range(n)))), f"mixed {i}", r)
same(mixed_in[0], np.full(3, float(r)), "out-of-place input untouched", r)
same(mixed_in[1], np.full(3, float(sum(range(n)))), "in-place input reduced", r)

# a large tensor goes through the chunked in-place path
large = np.arange(700_000, dtype=np.float32) % 13 + r
same(hvd.allreduce(large, op=hvd.Sum), (np.arange(700_000, dtype=np.float32) % 13) * n + sum(range(n)), "large", r)

# grouped allreduce: mixed dtypes in one unit
g = hvd.grouped_allreduce([value(r, "float32"), value(r, "int64", shape=(3,)), np.ones(0)], op=hvd.Sum)
same(g[0], every("float32").sum(0).astype("float32"), "grouped f32", r)
same(g[1], every("int64", shape=(3,)).sum(0), "grouped i64", r)
same(g[2], np.zeros(0), "grouped empty", r)
arrs = [np.full(2, float(r)), np.full(3, float(r))]
hvd.grouped_allreduce_(arrs, op=hvd.Max)
same(arrs[1], np.full(3, float(n - 1)), "grouped in place", r)

# allgather: first dimension differs per rank
for dtype in INTS + FLOATS + ["bool"]:
    mine = value(r, dtype, shape=(r + 1, 2))
    expected = np.concatenate([value(k, dtype, shape=(k + 1, 2)) for k in range(n)])
    same(hvd.allgather(mine, name=f"ag.{dtype}"), expected, f"allgather {dtype}", r)
same(hvd.allgather(np.int32(r)), np.arange(n, dtype=np.int32), "allgather 0-d", r)
same(hvd.allgather(np.zeros((0, 4))), np.zeros((0, 4)), "allgather empty", r)
ga = hvd.grouped_allgather([np.full((1,), r), np.full((r, 2), float(r))])
same(ga[0], np.arange(n), "grouped allgather 0", r)
same(ga[1], np.concatenate([np.full((k, 2), float(k)) for k in range(n)]), "grouped allgather 1", r)

# broadcast from every root
for root in range(n):
    for dtype in ["float32", "int8", "bool", "float16"]:
        same(hvd.broadcast(value(r, dtype), root_rank=root), value(root, dtype), f"broadcast {dtype} {root}", r)
b = np.full(3, float(r))
hvd.broadcast_(b, root_rank=n - 1)
same(b, np.full(3, float(n - 1)), "broadcast_", r)
raises(ValueError, lambda: hvd.broadcast(np.ones(1), root_rank=n), "out of range")

# alltoall: equal splits, explicit splits, received splits returned
send = np.arange(2 * n, dtype=np.float32) + 100 * r
out, rsplits = hvd.alltoall(send)
same(out, np.concatenate([np.arange(2 * r, 2 * r + 2, dtype=np.float32) + 100 * k for k in range(n)]), "alltoall", r)
same(rsplits, np.full(n, 2, dtype=np.int64), "alltoall splits", r)
splits = [(r + k) % 2 + 1 for k in range(n)]  # rows rank r sends to rank k
rows = np.repeat(np.arange(n), splits).astype(np.int64) * 10 + r
out, rsplits = hvd.alltoall(rows.reshape(-1, 1), splits=splits)
exp = np.concatenate([np.full(((k + r) % 2 + 1, 1), r * 10 + k, dtype=np.int64) for k in range(n)])
same(out, exp, "alltoall splits data", r)
same(rsplits, np.array([(k + r) % 2 + 1 for k in range(n)], dtype=np.int64), "alltoall recv splits", r)

# reducescatter: uneven first dimension, Sum and Average, grouped
rows = 2 * n + 1
data = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) + r
total = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * n + sum(range(n))
counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
lo = sum(counts[:r])
same(hvd.reducescatter(data, op=hvd.Sum), total[lo:lo + counts[r]], "reducescatter sum", r)
same(hvd.reducescatter(data), total[lo:lo + counts[r]] / n, "reducescatter average", r)
gr = hvd.grouped_reducescatter([data, data * 2], op=hvd.Sum)
same(gr[1], 2 * total[lo:lo + counts[r]], "grouped reducescatter", r)

# objects
same(np.array(hvd.broadcast_object({"from": r, "list": [1, 2]}, root_rank=n - 1)["from"]), np.array(n - 1),
     "broadcast_object", r)
assert hvd.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
assert hvd.broadcast_object(lambda v: v + r, root_rank=0)(1) == 1  # cloudpickle: lambdas travel

# process sets
evens = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
assert evens.process_set_id is not None and evens.size() == len(range(0, n, 2))
if r % 2 == 0:
    same(hvd.allreduce(np.array([r], np.int64), op=hvd.Sum, process_set=evens),
         np.array([sum(range(0, n, 2))], np.int64), "process set allreduce", r)
    same(hvd.broadcast(np.array([r]), root_rank=evens.size() - 1, process_set=evens),
         np.array([max(range(0, n, 2))]), "process set broadcast (root relative to the set)", r)
    assert evens.rank() == r // 2 and evens.included()
else:
    assert not evens.included() and evens.rank() == -1
    raises(ValueError, lambda: hvd.allreduce(np.ones(1), process_set=evens), "is not in process set")
raises(ValueError, lambda: hvd.add_process_set([k for k in range(n) if k % 2 == 0]), "already registered")
assert hvd.remove_process_set(evens) is True
raises(ValueError, lambda: hvd.allreduce(np.ones(1), process_set=evens), "not registered")
hvd.barrier()
print(f"OK rank {r}")
