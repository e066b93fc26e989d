"""Horovod's error types and scaling precision in the core: a reused in-flight name is a ValueError; prescale
and postscale factors are applied in float32 for half precision and in float64 for integers."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd

MPI_SIZES = (2, 3)

INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8)
FACTORS = (0.3, 0.5, 1.7, 2.5)


def _expected_int(values: np.ndarray, factor: float) -> np.ndarray:
    return np.trunc(values.astype(np.float64) * factor).astype(values.dtype)


def test_name_in_flight_is_a_value_error(rank: int, size: int) -> None:
    # The last rank submits first and alone (the name cannot complete before its second submission).
    if rank == size - 1:
        handle = hvd.allreduce_async(np.ones(1), name="conform.dup")
        with pytest.raises(ValueError, match="'conform.dup' is already in flight") as info:
            hvd.allreduce_async(np.ones(1), name="conform.dup")
        assert isinstance(info.value, hvd.HvdliteError) and isinstance(info.value, hvd.DuplicateNameError)
    hvd.barrier()
    if rank != size - 1:
        handle = hvd.allreduce_async(np.ones(1), name="conform.dup")
    assert hvd.synchronize(handle).tolist() == [1.0]


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("grouped", [False, True])
def test_integer_prescale_is_float64_then_truncated(dtype: type, grouped: bool, rank: int, size: int) -> None:
    base = (np.arange(-6, 6) * (rank + 1)).astype(dtype) if dtype != np.uint8 else \
        (np.arange(12) * (rank + 1)).astype(dtype)
    per_rank = [(np.arange(-6, 6) * (r + 1)).astype(dtype) if dtype != np.uint8 else
                (np.arange(12) * (r + 1)).astype(dtype) for r in range(size)]
    for factor in FACTORS:
        if grouped:
            got = hvd.grouped_allreduce([base, base[:5]], op=hvd.Sum, prescale_factor=factor)
        else:
            got = [hvd.allreduce(base, op=hvd.Sum, prescale_factor=factor)]
        expected = sum(_expected_int(v, factor).astype(np.int64) for v in per_rank).astype(dtype)
        np.testing.assert_array_equal(got[0], expected)
        assert got[0].dtype == dtype
        if grouped:
            np.testing.assert_array_equal(got[1], expected[:5])


@pytest.mark.parametrize("dtype", (np.int32, np.int64))
def test_integer_postscale_and_average(dtype: type, rank: int, size: int) -> None:
    base = (np.arange(-6, 6) * (rank + 1)).astype(dtype)
    total = sum((np.arange(-6, 6) * (r + 1)) for r in range(size)).astype(dtype)
    for factor in FACTORS:
        got = hvd.allreduce(base, op=hvd.Sum, postscale_factor=factor)
        np.testing.assert_array_equal(got, _expected_int(total, factor))
    # Average of equal multiples of the set size divides exactly.
    np.testing.assert_array_equal(hvd.allreduce(np.full(5, 7 * size, dtype), op=hvd.Average),
                                  np.full(5, 7 * size, dtype))
    got = hvd.allreduce(np.full(3, 2 * (rank + 1), dtype), op=hvd.Average)
    np.testing.assert_array_equal(got, np.full(3, size + 1, dtype))  # 2 * (1 + ... + n) / n


def test_float16_prescale_is_float32(rank: int, size: int) -> None:
    x = np.full(8, 1e-3, dtype=np.float16)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1e5)
    one = np.float16(np.float32(np.float16(1e-3)) * np.float32(1e5))
    expected = one
    for _ in range(size - 1):
        expected = np.float16(expected + one)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.full(8, expected, np.float16))
    got = hvd.allreduce(np.full(4, 100.0, np.float16), op=hvd.Sum, postscale_factor=1e-5)
    np.testing.assert_array_equal(got, np.full(4, np.float16(np.float32(100.0 * size) * np.float32(1e-5))))


def test_float16_grouped_and_reducescatter(rank: int, size: int) -> None:
    x = np.full((size * 2, 3), 1e-3, dtype=np.float16)
    one = np.float16(np.float32(np.float16(1e-3)) * np.float32(1e5))
    expected = one
    for _ in range(size - 1):
        expected = np.float16(expected + one)
    grouped = hvd.grouped_allreduce([x, x[:1]], op=hvd.Sum, prescale_factor=1e5)
    np.testing.assert_array_equal(grouped[0], np.full(x.shape, expected))
    np.testing.assert_array_equal(grouped[1], np.full((1, 3), expected))
    scattered = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=1e5)
    np.testing.assert_array_equal(scattered, np.full((2, 3), expected))


def test_integer_reducescatter_scaling(rank: int, size: int) -> None:
    x = (np.arange(size * 4).reshape(size * 2, 2) * (rank + 1)).astype(np.int32)
    total = sum(np.arange(size * 4).reshape(size * 2, 2) * (r + 1) for r in range(size)).astype(np.int32)
    got = hvd.reducescatter(x, op=hvd.Sum, postscale_factor=0.3)
    np.testing.assert_array_equal(got, _expected_int(total, 0.3)[2 * rank:2 * rank + 2])
    got = hvd.reducescatter(np.full((size, 2), 3 * size, np.int64), op=hvd.Average)
    np.testing.assert_array_equal(got, np.full((1, 2), 3 * size, np.int64))
