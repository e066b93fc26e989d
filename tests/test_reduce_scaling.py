"""Single-process tests of the scaling arithmetic: Horovod's precision for prescale/postscale and Average."""
from __future__ import annotations

import numpy as np
import pytest

from hvdlite.core.reduce_ops import Scale, bf16_to_f32, f32_to_bf16, scale_inplace, scaled_copy


@pytest.mark.parametrize("n", [3, 7, 49, 98, 127, 255])
def test_integer_average_is_exact_where_the_quotient_is(n: int) -> None:
    sums = np.arange(-5 * n, 6 * n, n, dtype=np.int64)  # multiples of n, negative ones included
    for dtype in (np.int32, np.int64, np.int16):
        values = sums.astype(dtype)
        scale_inplace(values, np.dtype(dtype).name, Scale(1.0, n))
        np.testing.assert_array_equal(values, (sums // n).astype(dtype))
    assert np.trunc(np.float64(49) * (1.0 / 49)) == 0  # what the old sum * (1/n) gave


def test_integer_average_truncates_toward_zero_like_a_c_cast() -> None:
    values = np.array([7, -7, 5, -5], dtype=np.int32)
    scale_inplace(values, "int32", Scale(1.0, 2))
    np.testing.assert_array_equal(values, [3, -3, 2, -2])


def test_integer_scaling_happens_in_float64() -> None:
    values = np.array([3, 10, -10], dtype=np.int32)
    scale_inplace(values, "int32", 2.5)
    np.testing.assert_array_equal(values, [7, 25, -25])
    big = np.array([2**40 + 3], dtype=np.int64)
    scale_inplace(big, "int64", Scale(3.0, 3))  # x * 3 / 3, exact in float64
    assert big[0] == 2**40 + 3
    user_post = np.array([12], dtype=np.int32)
    scale_inplace(user_post, "int32", Scale(0.5, 3))  # postscale 0.5, then Average over 3
    assert user_post[0] == 2


def test_float16_prescale_is_computed_in_float32() -> None:
    values = np.full(4, 1e-3, dtype=np.float16)
    scale_inplace(values, "float16", 1e5)
    assert np.isfinite(values).all()
    assert values[0] == np.float16(np.float32(np.float16(1e-3)) * np.float32(1e5))
    dst = np.empty(4, dtype=np.float16)
    scaled_copy(dst, np.full(4, 1e-3, dtype=np.float16), "float16", 1e5)
    np.testing.assert_array_equal(dst, values)


def test_float16_average_rounds_once_from_float32() -> None:
    values = np.array([3.0, 1.0, 2049.0], dtype=np.float16)
    scale_inplace(values, "float16", Scale(1.0, 3))
    expected = (np.array([3.0, 1.0, 2049.0], dtype=np.float16).astype(np.float32) * np.float32(1 / 3))
    np.testing.assert_array_equal(values, expected.astype(np.float16))


def test_bfloat16_scaling_in_float32() -> None:
    bits = f32_to_bf16(np.array([1e-3, 2.0], dtype=np.float32))
    scale_inplace(bits, "bfloat16", 1e5)
    got = bf16_to_f32(bits)
    expected = bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(np.array([1e-3, 2.0], np.float32)))
                                       * np.float32(1e5)))
    np.testing.assert_array_equal(got, expected)


def test_scale_is_a_float_equal_to_the_quotient() -> None:
    s = Scale(2.0, 4)
    assert float(s) == 0.5 and s.factor == 2.0 and s.divisor == 4
    assert Scale(1.0, 1) == 1.0  # one rank: nothing to scale
    f32 = np.array([3.0], dtype=np.float32)
    scale_inplace(f32, "float32", Scale(1.0, 2))
    assert f32[0] == np.float32(1.5)


def test_bool_refuses_scaling() -> None:
    with pytest.raises(TypeError, match="scale factors are not defined for bool tensors"):
        scale_inplace(np.array([True]), "bool", 2.0)


@pytest.mark.parametrize("factor", [1.0 / 3, 0.1915194503788923, 0.1, 1.7, 0.5, 2.0])
def test_float32_is_scaled_by_the_factor_rounded_to_float32(factor: float) -> None:
    """Horovod's CPU ScaleBuffer casts the double factor to float and multiplies in float32 (its tests build
    the expected value as ``factor.type(torch.float32) * tensor``), not one rounding of the double product."""
    x = (np.random.default_rng(5).standard_normal(100_003) * 50).astype(np.float32)
    want = x * np.float32(factor)
    assert not np.array_equal(want, (x.astype(np.float64) * factor).astype(np.float32)) or \
        float(np.float32(factor)) == factor  # the two roundings differ where the factor is not a float32
    got = x.copy()
    scale_inplace(got, "float32", factor)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    into = np.empty_like(x)
    scaled_copy(into, x, "float32", factor)
    np.testing.assert_array_equal(into.view(np.uint32), want.view(np.uint32))
    avg = x.copy()
    scale_inplace(avg, "float32", Scale(factor, 3))  # Horovod: postscale / size in double, then float
    want_avg = x / np.float32(3) if factor == 1.0 else x * np.float32(factor / 3)
    np.testing.assert_array_equal(avg.view(np.uint32), want_avg.view(np.uint32))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8, 12, 64, 99, 1024])
def test_float_average_divides_and_with_a_user_factor_multiplies(n: int) -> None:
    """A plain Average divides by n, correctly rounded (Horovod's tests expect ``t / size`` exactly, e.g.
    test_horovod_join_allreduce at 3 ranks; a power of two multiplies by 1/n instead, which is the same bits);
    with a user's postscale f it multiplies by ``f / n`` computed in double, rounded to float32 for float32
    and float16 (Horovod's ScaleBuffer); subnormal, huge and non-finite values and signed zeros included."""
    bits = np.random.default_rng(n).integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.4e-45, -1.4e-45, 3.4e38], dtype=np.float32)
        every = np.concatenate([x, special])
        got = every.copy()
        scale_inplace(got, "float32", Scale(1.0, n))
        np.testing.assert_array_equal(got.view(np.uint32), (every / np.float32(n)).view(np.uint32))
        wide = np.random.default_rng(n).integers(0, 2**63, size=1 << 16, dtype=np.uint64).view(np.float64)
        wide = np.concatenate([wide, -wide, special.astype(np.float64), [5e-324, 1.7e308]])
        got_wide = wide.copy()
        scale_inplace(got_wide, "float64", Scale(1.0, n))
        np.testing.assert_array_equal(got_wide.view(np.uint64), (wide / np.float64(n)).view(np.uint64))
    x = x[np.isfinite(x)]
    got = x.copy()
    scale_inplace(got, "float32", Scale(0.7, n))
    np.testing.assert_array_equal(got.view(np.uint32), (x * np.float32(0.7 / n)).view(np.uint32))
    d = x.astype(np.float64) * 3.7
    got64 = d.copy()
    scale_inplace(got64, "float64", Scale(1.0, n))
    np.testing.assert_array_equal(got64, d / n)
    h = x[np.abs(x) < 6e4].astype(np.float16)
    got16 = h.copy()
    scale_inplace(got16, "float16", Scale(1.0, n))
    np.testing.assert_array_equal(got16.view(np.uint16),
                                  (h.astype(np.float32) / np.float32(n)).astype(np.float16).view(np.uint16))


def test_integers_with_a_user_factor_multiply_by_the_double_factor() -> None:
    """With a user's postscale, Average over integers multiplies by ``double(f / n)`` and truncates, as
    Horovod; only the plain Average (no user factor) divides exactly."""
    x = np.arange(-60, 61, dtype=np.int64)
    got = x.copy()
    scale_inplace(got, "int64", Scale(0.7, 3))
    np.testing.assert_array_equal(got, np.trunc(x.astype(np.float64) * (0.7 / 3)).astype(np.int64))


def _sum_in_order(parts: list[np.ndarray], tree: bool) -> np.ndarray:
    """The ranks' contributions added one after the other, or pairwise by recursive halving (MPI's orders)."""
    if not tree:
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total
    while len(parts) > 1:
        parts = [parts[i] + parts[i + len(parts) // 2] for i in range(len(parts) // 2)]
    return parts[0]


def _average_and_predivided(parts: list[np.ndarray], n: int, prescale: float, tree: bool
                            ) -> tuple[np.ndarray, np.ndarray]:
    """The same contributions averaged two ways: summed, then divided by ``n`` (Average's postscale); and each
    scaled by ``prescale`` first, then summed with nothing after."""
    dtype = parts[0].dtype.name
    with np.errstate(over="ignore"):  # a sum may overflow (the case shown in the test)
        average = _sum_in_order(list(parts), tree)
    scale_inplace(average, dtype, Scale(1.0, n))
    predivided = []
    for part in parts:
        scaled = np.empty_like(part)
        scaled_copy(scaled, part, dtype, prescale)
        predivided.append(scaled)
    return average, _sum_in_order(predivided, tree)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_dividing_before_the_sum_gives_averages_bits_for_a_power_of_two_size(n: int) -> None:
    """gradient_predivide_factor=size (docs/torch.md): each rank's gradient is divided by the size before the
    sum and nothing is scaled after it. For a power-of-two size that is Average's result bit for bit, in any
    order of summation, unless some x / size falls below the dtype's smallest normal (it loses bits there) or
    a sum overflows (Average's result is then inf, the predivided sum finite): both cases are shown below."""
    from hvdlite.core.frontend import gradient_scales, resolve_op
    scales = gradient_scales(resolve_op("average"), float(n))
    post = Scale(scales.postscale, n)
    assert post == 1.0  # nothing is left to scale after the sum
    rng = np.random.default_rng(n)
    for dtype in (np.float32, np.float64):
        info = np.finfo(dtype)
        lo, hi = int(np.log2(float(info.tiny))) + int(np.log2(n)), int(np.log2(float(info.max))) - int(np.log2(n))
        shape = (n, 8192)
        values = (rng.choice([-1.0, 1.0], shape) * rng.uniform(1.0, 2.0, shape)
                  * np.exp2(rng.integers(lo, hi, shape).astype(np.float64))).astype(dtype)
        values[1, :2048] = -values[0, :2048] * dtype(1 + 4 * info.eps)  # partial sums that cancel to tiny ones
        values[:, -16:] = 0.0
        for tree in (False, True):
            average, total = _average_and_predivided(list(values), n, scales.prescale, tree)
            np.testing.assert_array_equal(total.view(f"u{np.dtype(dtype).itemsize}"),
                                          average.view(f"u{np.dtype(dtype).itemsize}"), err_msg=f"{dtype} {tree}")
    tiny = np.float32(np.finfo(np.float32).tiny) * np.float32(1 + np.finfo(np.float32).eps)  # odd last bit
    big = np.float32(np.finfo(np.float32).max) * np.float32(0.75)
    for x, expect_finite in ((tiny, True), (big, False)):
        average, total = _average_and_predivided([np.full(1, x, np.float32) for _ in range(n)], n, scales.prescale,
                                                 False)
        assert total[0] != average[0] and np.isfinite(total[0])
        assert np.isfinite(average[0]) == expect_finite
