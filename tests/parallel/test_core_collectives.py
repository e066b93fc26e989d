"""Every core collective, dtype and reduce op against numpy-computed expectations, exactly."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from exact import same

MPI_SIZES = (2, 3)
INTS = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"]
FLOATS = ["float16", "float32", "float64"]
OPS = [(hvd.Sum, np.sum), (hvd.Min, np.min), (hvd.Max, np.max), (hvd.Product, np.prod)]
R, N = hvd.rank(), hvd.size()
TRI = sum(range(N))  # 0 + 1 + ... + (N - 1)


def value(rank: int, dtype: str, shape: tuple = (2, 3), lo: int = 1, hi: int = 4) -> np.ndarray:
    data = (np.arange(int(np.prod(shape))).reshape(shape) + 3 * rank) % (hi - lo) + lo
    return data.astype(dtype)


def every(dtype: str, **kw) -> np.ndarray:
    return np.stack([value(k, dtype, **kw) for k in range(N)])


@pytest.mark.parametrize("dtype", INTS + FLOATS)
def test_allreduce_every_dtype_and_op(dtype: str) -> None:
    for op, reduce in OPS:
        got = hvd.allreduce(value(R, dtype), op=op, name=f"ar.{dtype}.{op.value}")
        same(got, reduce(every(dtype), axis=0).astype(dtype), f"allreduce {dtype} {op}")
    if dtype in FLOATS:
        got = hvd.allreduce(value(R, dtype), name=f"avg.{dtype}")
        same(got, (every(dtype).astype(np.float64).sum(0) / N).astype(dtype), f"average {dtype}")
    else:  # integer average truncates toward zero
        got = hvd.allreduce(value(R, dtype), op=hvd.Average, name=f"avg.{dtype}")
        same(got, np.trunc(every(dtype).astype(np.float64).sum(0) / N).astype(dtype), f"average {dtype}")


def test_bool_ops_are_logical_and_average_is_refused() -> None:
    flags = np.array([R == 0, True, False, R % 2 == 1])
    all_flags = np.stack([np.array([k == 0, True, False, k % 2 == 1]) for k in range(N)])
    same(hvd.allreduce(flags, op=hvd.Sum), all_flags.any(0), "bool sum")
    same(hvd.allreduce(flags, op=hvd.Max), all_flags.any(0), "bool max")
    same(hvd.allreduce(flags, op=hvd.Min), all_flags.all(0), "bool min")
    same(hvd.allreduce(flags, op=hvd.Product), all_flags.all(0), "bool product")
    with pytest.raises(TypeError, match="not defined for bool"):
        hvd.allreduce(flags)


def test_bfloat16_travels_as_uint16_bits_with_a_dtype_hint() -> None:
    bf = (np.array([1.0, 2.5, -3.0], dtype=np.float32) * (R + 1)).view(np.uint32) >> 16
    got = hvd.allreduce_async(bf.astype(np.uint16), op=hvd.Sum, dtype_hint="bfloat16").wait()
    got_f32 = (got.astype(np.uint32) << 16).view(np.float32)
    same(got_f32, np.array([1.0, 2.5, -3.0], np.float32) * sum(range(1, N + 1)), "bfloat16 sum")


def test_scale_factors_and_average_argument() -> None:
    x = np.full(5, R + 1, dtype=np.float64)
    same(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
         np.full(5, float(sum(range(1, N + 1)))), "pre/postscale")
    same(hvd.allreduce(x, average=False), np.full(5, float(sum(range(1, N + 1)))), "average=False")
    same(hvd.allreduce(x, average=True), np.full(5, sum(range(1, N + 1)) / N), "average=True")


def test_in_place_non_contiguous_empty_zero_dim_and_async() -> None:
    y = np.full(4, float(R))
    out = hvd.allreduce_(y, op=hvd.Sum)
    assert out is y, "allreduce_ returns the same array"
    same(y, np.full(4, float(TRI)), "allreduce_ in place")
    big = np.arange(24, dtype=np.float32).reshape(4, 6) + R
    view = big[:, ::2]  # non-contiguous
    hvd.allreduce_(view, op=hvd.Sum)
    same(big[:, ::2], (np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2] * N + TRI), "non-contig")
    same(big[:, 1::2], np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1::2] + R, "non-contig untouched")
    same(hvd.allreduce(np.zeros((0, 3), np.float32)), np.zeros((0, 3), np.float32), "empty")
    same(hvd.allreduce(np.float64(R), op=hvd.Sum), np.float64(TRI), "0-d")
    h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="async.one")
    assert isinstance(hvd.poll(h), bool)
    same(hvd.synchronize(h), np.full(3, float(N)), "async")


def test_in_place_and_out_of_place_fused_in_one_cycle() -> None:
    mixed_in = [np.full(3, float(R)) for _ in range(4)]
    handles = [hvd.allreduce_async_(a, op=hvd.Sum, name=f"mixed.in.{i}") if i % 2 else
               hvd.allreduce_async(a, op=hvd.Sum, name=f"mixed.out.{i}") for i, a in enumerate(mixed_in)]
    for i, h in enumerate(handles):
        same(hvd.synchronize(h), np.full(3, float(TRI)), f"mixed {i}")
    same(mixed_in[0], np.full(3, float(R)), "out-of-place input untouched")
    same(mixed_in[1], np.full(3, float(TRI)), "in-place input reduced")


def test_large_tensor_takes_the_chunked_in_place_path() -> None:
    large = np.arange(700_000, dtype=np.float32) % 13 + R
    same(hvd.allreduce(large, op=hvd.Sum), (np.arange(700_000, dtype=np.float32) % 13) * N + TRI, "large")


def test_average_of_a_batch_of_chunked_and_fused_tensors_with_chunks_in_flight() -> None:
    """Large tensors travel as 1 MiB chunks, several in flight, each scaled (Average) while later ones
    travel; small ones fuse between them. Every element must be Horovod's float32(double(sum) * (1 / n))."""
    sizes = [700_000, 5, 300_000, 17, 262_145]  # 2.8 MB, fused, 1.2 MB, fused, one chunk and one element

    def grads(rank: int) -> list:  # multiples of 1/64 below 2**10: every sum is exact in any order
        rng = np.random.default_rng(100 + rank)
        return [(rng.integers(-2 ** 16, 2 ** 16, n) / 64).astype(np.float32) for n in sizes]
    got = grads(R)
    hvd.grouped_allreduce_(got, op=hvd.Average, name="avg.chunked.batch")
    for i, g in enumerate(got):
        total = sum(grads(k)[i].astype(np.float64) for k in range(N))
        same(g, (total * (1.0 / N)).astype(np.float32), f"average chunked {i}")


def test_grouped_allreduce_mixed_dtypes_and_in_place() -> None:
    g = hvd.grouped_allreduce([value(R, "float32"), value(R, "int64", shape=(3,)), np.ones(0)], op=hvd.Sum)
    same(g[0], every("float32").sum(0).astype("float32"), "grouped f32")
    same(g[1], every("int64", shape=(3,)).sum(0), "grouped i64")
    same(g[2], np.zeros(0), "grouped empty")
    arrs = [np.full(2, float(R)), np.full(3, float(R))]
    hvd.grouped_allreduce_(arrs, op=hvd.Max)
    same(arrs[1], np.full(3, float(N - 1)), "grouped in place")


@pytest.mark.parametrize("dtype", INTS + FLOATS + ["bool"])
def test_allgather_first_dimension_differs_per_rank(dtype: str) -> None:
    mine = value(R, dtype, shape=(R + 1, 2))
    expected = np.concatenate([value(k, dtype, shape=(k + 1, 2)) for k in range(N)])
    same(hvd.allgather(mine, name=f"ag.{dtype}"), expected, f"allgather {dtype}")


def test_allgather_zero_dim_empty_and_grouped() -> None:
    same(hvd.allgather(np.int32(R)), np.arange(N, dtype=np.int32), "allgather 0-d")
    same(hvd.allgather(np.zeros((0, 4))), np.zeros((0, 4)), "allgather empty")
    ga = hvd.grouped_allgather([np.full((1,), R), np.full((R, 2), float(R))])
    same(ga[0], np.arange(N), "grouped allgather 0")
    same(ga[1], np.concatenate([np.full((k, 2), float(k)) for k in range(N)]), "grouped allgather 1")


def test_broadcast_from_every_root() -> None:
    for root in range(N):
        for dtype in ["float32", "int8", "bool", "float16"]:
            same(hvd.broadcast(value(R, dtype), root_rank=root), value(root, dtype), f"broadcast {dtype} {root}")
    b = np.full(3, float(R))
    hvd.broadcast_(b, root_rank=N - 1)
    same(b, np.full(3, float(N - 1)), "broadcast_")
    with pytest.raises(ValueError, match=rf"root_rank is not a member of the process set \(ranks .*: {N}\)"):
        hvd.broadcast(np.ones(1), root_rank=N)


def test_alltoall_equal_and_explicit_splits() -> None:
    send = np.arange(2 * N, dtype=np.float32) + 100 * R
    out, rsplits = hvd.alltoall(send)
    same(out, np.concatenate([np.arange(2 * R, 2 * R + 2, dtype=np.float32) + 100 * k for k in range(N)]),
         "alltoall")
    same(rsplits, np.full(N, 2, dtype=np.int64), "alltoall splits")
    splits = [(R + k) % 2 + 1 for k in range(N)]  # rows rank R sends to rank k
    rows = np.repeat(np.arange(N), splits).astype(np.int64) * 10 + R
    out, rsplits = hvd.alltoall(rows.reshape(-1, 1), splits=splits)
    exp = np.concatenate([np.full(((k + R) % 2 + 1, 1), R * 10 + k, dtype=np.int64) for k in range(N)])
    same(out, exp, "alltoall splits data")
    same(rsplits, np.array([(k + R) % 2 + 1 for k in range(N)], dtype=np.int64), "alltoall recv splits")


def test_reducescatter_uneven_sum_average_grouped() -> None:
    rows = 2 * N + 1
    data = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) + R
    total = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * N + TRI
    counts = [rows // N + (1 if k < rows % N else 0) for k in range(N)]
    lo = sum(counts[:R])
    same(hvd.reducescatter(data, op=hvd.Sum), total[lo:lo + counts[R]], "reducescatter sum")
    same(hvd.reducescatter(data), total[lo:lo + counts[R]] / N, "reducescatter average")
    gr = hvd.grouped_reducescatter([data, data * 2], op=hvd.Sum)
    same(gr[1], 2 * total[lo:lo + counts[R]], "grouped reducescatter")


def test_objects() -> None:
    same(np.array(hvd.broadcast_object({"from": R, "list": [1, 2]}, root_rank=N - 1)["from"]), np.array(N - 1),
         "broadcast_object")
    assert hvd.allgather_object(("rank", R)) == [("rank", k) for k in range(N)]
    assert hvd.broadcast_object(lambda v: v + R, root_rank=0)(1) == 1  # cloudpickle: lambdas travel


def test_process_sets() -> None:
    evens = hvd.add_process_set([k for k in range(N) if k % 2 == 0])
    assert evens.process_set_id is not None and evens.size() == len(range(0, N, 2))
    if R % 2 == 0:
        same(hvd.allreduce(np.array([R], np.int64), op=hvd.Sum, process_set=evens),
             np.array([sum(range(0, N, 2))], np.int64), "process set allreduce")
        same(hvd.broadcast(np.array([R]), root_rank=max(range(0, N, 2)), process_set=evens),
             np.array([max(range(0, N, 2))]), "process set broadcast (root_rank: a rank of the job)")
        assert evens.rank() == R // 2 and evens.included()
    else:
        assert not evens.included() and evens.rank() == -1
        with pytest.raises(ValueError, match="is not in process set"):
            hvd.allreduce(np.ones(1), process_set=evens)
    with pytest.raises(ValueError, match="already registered"):
        hvd.add_process_set([k for k in range(N) if k % 2 == 0])
    assert hvd.remove_process_set(evens) is True
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(np.ones(1), process_set=evens)
    hvd.barrier()
