"""Scaling bit for bit as Horovod's CPU ScaleBuffer rounds it, at 2, 3 and 4 ranks: float32 and float16 (bfloat16
too) are multiplied by the factor rounded to float32, in float32; float64 by the double factor; integers in
float64, truncated. A plain Average divides by the size, correctly rounded (integers truncated).
Every op that scales: Average, prescale, postscale, reducescatter (Average and prescaled, grouped too), and
Average while a rank has joined. Every rank holds the same tensor, so the sums do not depend on MPI's order (and
in the last test each rank its own: the Average is then the same reduction's Sum, divided)."""
from __future__ import annotations

import numpy as np

import hvdlite as hvd
from hvdlite.core.reduce_ops import bf16_to_f32, f32_to_bf16

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 240
R, N = hvd.rank(), hvd.size()
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "uint8", "int16", "int32", "int64")
FACTORS = (1.0 / 3, 0.1, 1.7, 2.0)


def tensor(dtype: str, rows: int = 6) -> np.ndarray:
    rng = np.random.default_rng(1234)  # the same on every rank
    if dtype in INTS:
        return rng.integers(0 if dtype == "uint8" else -20, 20, size=(rows, 5)).astype(dtype)
    values = (rng.standard_normal((rows, 5)) * 7).astype(np.float32)
    return f32_to_bf16(values) if dtype == "bfloat16" else values.astype(dtype)


def scaled(x: np.ndarray, dtype: str, factor: float) -> np.ndarray:
    """Horovod's product: float32 math with the factor rounded to float32 (float16/bfloat16 rounded back once),
    float64 math for float64 and integers (integers truncated toward zero)."""
    if factor == 1.0:
        return x
    if dtype == "bfloat16":
        return f32_to_bf16(bf16_to_f32(x) * np.float32(factor))
    if dtype == "float16":
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    if dtype in INTS:
        return np.trunc(x.astype(np.float64) * factor).astype(dtype)
    if dtype == "float32":
        return x * np.float32(factor)
    return x * np.float64(factor)


def summed(x: np.ndarray, dtype: str, k: int) -> np.ndarray:
    """k equal contributions, summed (exact for the small integers; one rounding for floats)."""
    if dtype == "bfloat16":
        return f32_to_bf16(bf16_to_f32(x) * np.float32(k))
    if dtype == "float16":
        return (x.astype(np.float32) * np.float32(k)).astype(np.float16)
    return (x * x.dtype.type(k)).astype(x.dtype) if dtype in INTS else (x.astype(np.float64) * k).astype(dtype)


def average(total: np.ndarray, dtype: str, ranks: int) -> np.ndarray:
    """A plain Average divides, correctly rounded (integers truncated toward zero)."""
    if dtype in INTS:
        return np.trunc(total.astype(np.float64) / ranks).astype(dtype)
    if dtype == "bfloat16":
        return f32_to_bf16(bf16_to_f32(total) / np.float32(ranks))
    if dtype == "float16":
        return (total.astype(np.float32) / np.float32(ranks)).astype(np.float16)
    return total / total.dtype.type(ranks)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.itemsize}") if a.dtype.kind == "f" else a


def exact(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    diff = np.flatnonzero(bits(got).reshape(-1) != bits(want).reshape(-1))
    assert diff.size == 0, f"{what}: {diff.size} elements differ, e.g. got {got.reshape(-1)[diff[:3]]} " \
                           f"expected {want.reshape(-1)[diff[:3]]}"


def hint(dtype: str) -> dict:
    return {"dtype_hint": "bfloat16"} if dtype == "bfloat16" else {}


def test_allreduce_average_prescale_postscale() -> None:
    for dtype, rows in [(d, r) for d in FLOATS + INTS for r in (6, 40_001)]:  # 40,001 rows: chunks of 1 MiB
        x = tensor(dtype, rows)
        got = hvd.allreduce_async(x, op=hvd.Average, **hint(dtype)).wait()
        exact(got, average(summed(x, dtype, N), dtype, N), f"{dtype} Average")
        exact(hvd.allreduce_async(x.copy(), op=hvd.Average, inplace=True, **hint(dtype)).wait(), got,
              f"{dtype} Average in place")
        for f in FACTORS:
            if dtype in INTS and dtype.startswith("u") and f < 1:
                continue
            got = hvd.allreduce_async(x, op=hvd.Sum, prescale_factor=f, **hint(dtype)).wait()
            exact(got, summed(scaled(x, dtype, f), dtype, N), f"{dtype} prescale {f}")
            got = hvd.allreduce_async(x, op=hvd.Sum, postscale_factor=f, **hint(dtype)).wait()
            exact(got, scaled(summed(x, dtype, N), dtype, f), f"{dtype} postscale {f}")
            if dtype in FLOATS:  # Average after a prescale: the sum of the scaled tensors, then / N
                got = hvd.allreduce_async(x, op=hvd.Average, prescale_factor=f, **hint(dtype)).wait()
                exact(got, average(summed(scaled(x, dtype, f), dtype, N), dtype, N), f"{dtype} Average pre {f}")
        fused = hvd.grouped_allreduce([x.astype(x.dtype), x.copy()], op=hvd.Average) if dtype != "bfloat16" \
            else None
        if fused is not None:
            for i, part in enumerate(fused):
                exact(part, average(summed(x, dtype, N), dtype, N), f"{dtype} grouped Average {i}")


def rows_of_rank(total_rows: int) -> slice:
    base, extra = divmod(total_rows, N)
    start = R * base + min(R, extra)
    return slice(start, start + base + (1 if R < extra else 0))


def test_reducescatter_average_and_prescale() -> None:
    for dtype in FLOATS + ("int32", "int64"):
        x = tensor(dtype, rows=7)
        mine = rows_of_rank(7)
        got = hvd.reducescatter_async(x, op=hvd.Average, **hint(dtype)).wait()
        exact(got, average(summed(x, dtype, N), dtype, N)[mine], f"{dtype} reducescatter Average")
        for f in FACTORS:
            got = hvd.reducescatter_async(x, op=hvd.Sum, prescale_factor=f, **hint(dtype)).wait()
            exact(got, summed(scaled(x, dtype, f), dtype, N)[mine], f"{dtype} reducescatter prescale {f}")
            if dtype != "bfloat16":
                a, b = hvd.grouped_reducescatter([x, x[:4].copy()], op=hvd.Sum, prescale_factor=f,
                                                 postscale_factor=1.0 / 7)
                want = scaled(summed(scaled(x, dtype, f), dtype, N), dtype, 1.0 / 7)
                exact(a, want[mine], f"{dtype} grouped reducescatter pre {f} post 1/7 (first)")
                exact(b, want[:4][rows_of_rank(4)], f"{dtype} grouped reducescatter pre {f} post 1/7 (second)")


def test_average_while_a_rank_has_joined() -> None:
    """The last rank joins; the others' Average still divides by the set's size (the joined rank adds zeros)."""
    if R == N - 1:
        assert hvd.join() in range(N)
        return
    for dtype in ("float16", "float32", "float64", "int32"):
        x = tensor(dtype, 40_001)
        got = hvd.allreduce(x, op=hvd.Average, name=f"joined.{dtype}")
        exact(got, average(summed(x, dtype, N - 1), dtype, N), f"{dtype} Average with a joined rank")
    assert hvd.join() in range(N)


def test_average_of_different_values_is_the_sum_divided_on_every_rank() -> None:
    """Each rank its own values: the Average is the Sum of the same reduction, divided, bit for bit (whatever order
    MPI sums in), small and in 1 MiB chunks, and the same on every rank."""
    rng = np.random.default_rng(R)
    for dtype, size in [(d, s) for d in ("float16", "float32", "float64") for s in (30, 300_001)]:
        x = (rng.standard_normal(size) * 1e3).astype(dtype)
        total = hvd.allreduce(x, op=hvd.Sum, name=f"own.sum.{dtype}.{size}")
        got = hvd.allreduce(x, op=hvd.Average, name=f"own.avg.{dtype}.{size}")
        exact(got, average(total, dtype, N), f"{dtype} Average of each rank's own values, {size} elements")
        exact(np.asarray(hvd.broadcast(got, 0, name=f"own.bcast.{dtype}.{size}")), got, f"{dtype} on rank {R}")
