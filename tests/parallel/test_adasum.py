"""hvd.Adasum: the engine's tree against a numpy reference of the formula, its invariants, every float dtype,
fusion (each tensor its own vector), and the clear error on a set that is not a power of two."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from adasum_reference import reference

MPI_SIZES = (2, 3, 4)
POW2 = pytest.mark.mpi(sizes=(2, 4))


def inputs(size: int, n: int, seed: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(size)]


@POW2
@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
def test_matches_numpy_reference_of_the_tree(rank: int, size: int, n: int) -> None:
    vectors = inputs(size, n, seed=n)
    out = hvd.allreduce(vectors[rank], op=hvd.Adasum, name=f"ref.{n}")
    np.testing.assert_allclose(out, reference(vectors), rtol=1e-12, atol=1e-12)


@POW2
def test_two_vectors_follow_the_formula_exactly(rank: int, size: int) -> None:
    a, b = np.array([3.0, 1.0, -2.0]), np.array([1.0, 4.0, 0.5])
    dot = a @ b
    expected = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    if size == 2:
        out = hvd.allreduce([a, b][rank], op=hvd.Adasum, name="formula")
        np.testing.assert_allclose(out, expected, rtol=1e-15)
    assert np.allclose(reference([a, b]), expected)


@POW2
def test_identical_inputs_return_that_input(rank: int) -> None:
    v = np.linspace(-1, 2, 33)
    np.testing.assert_allclose(hvd.allreduce(v, op=hvd.Adasum, name="same"), v, rtol=1e-14)


@POW2
def test_orthogonal_inputs_return_their_sum(rank: int, size: int) -> None:
    vectors = [np.eye(size)[r] * (r + 1) for r in range(size)]
    np.testing.assert_allclose(hvd.allreduce(vectors[rank], op=hvd.Adasum, name="orth"), sum(vectors),
                               rtol=1e-14)


@POW2
def test_scale_equivariance(rank: int, size: int) -> None:
    vectors = inputs(size, 50, seed=7)
    plain = hvd.allreduce(vectors[rank], op=hvd.Adasum, name="scale.1")
    scaled = hvd.allreduce(vectors[rank] * 3.5, op=hvd.Adasum, name="scale.2")
    np.testing.assert_allclose(scaled, 3.5 * plain, rtol=1e-12)
    pre = hvd.allreduce(vectors[rank], op=hvd.Adasum, name="scale.3", prescale_factor=3.5)
    np.testing.assert_allclose(pre, 3.5 * plain, rtol=1e-12)


@POW2
@pytest.mark.parametrize("dtype,rtol", [(np.float16, 2e-3), (np.float32, 1e-5), (np.float64, 1e-12)])
def test_float_dtypes(rank: int, size: int, dtype, rtol: float) -> None:
    vectors = inputs(size, 300, seed=3, dtype=dtype)
    out = hvd.allreduce(vectors[rank], op=hvd.Adasum, name=f"dtype.{np.dtype(dtype).name}")
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float64), reference([v.astype(np.float64) for v in vectors]),
                               rtol=rtol, atol=rtol)


@POW2
def test_bfloat16_through_a_dtype_hint(rank: int, size: int) -> None:
    from hvdlite.core.reduce_ops import bf16_to_f32, f32_to_bf16
    vectors = [f32_to_bf16(v.astype(np.float32)) for v in inputs(size, 64, seed=11)]
    out = hvd.synchronize(hvd.allreduce_async(vectors[rank], op=hvd.Adasum, name="bf16", dtype_hint="bfloat16"))
    expected = reference([bf16_to_f32(v).astype(np.float64) for v in vectors])
    np.testing.assert_allclose(bf16_to_f32(out), expected, rtol=2e-2, atol=2e-2)


@POW2
@pytest.mark.parametrize("fusion", [4 << 20, 0], ids=["fused", "unfused"])
def test_each_fused_tensor_is_its_own_vector(reinit, rank: int, size: int, fusion: int) -> None:
    reinit(fusion_threshold_bytes=fusion)
    groups = [inputs(size, n, seed=n) for n in (5, 17, 2)]
    outs = hvd.grouped_allreduce([g[rank] for g in groups], op=hvd.Adasum, name="group")
    for out, g in zip(outs, groups):
        np.testing.assert_allclose(out, reference(g), rtol=1e-12)


@POW2
def test_integer_tensors_and_reducescatter_are_refused(rank: int) -> None:
    with pytest.raises(TypeError, match="hvd.Adasum needs floating-point tensors"):
        hvd.allreduce(np.ones(3, np.int32), op=hvd.Adasum, name="ints")
    with pytest.raises(NotImplementedError, match="only defined for allreduce"):
        hvd.reducescatter(np.ones(4), op=hvd.Adasum, name="rs")


@pytest.mark.mpi(sizes=(3,))
def test_three_ranks_get_a_clear_error(rank: int) -> None:
    with pytest.raises(ValueError, match=r"hvd.Adasum needs a power-of-two number of ranks in the process set "
                                         r"\(got 3\)"):
        hvd.allreduce(np.ones(3), op=hvd.Adasum, name="three")
    pair = hvd.add_process_set([0, 1])
    try:
        if rank < 2:  # a power-of-two process set inside a 3-rank job works
            a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
            out = hvd.allreduce([a, b][rank], op=hvd.Adasum, name="pair", process_set=pair)
            np.testing.assert_allclose(out, [1.0, 2.0])
    finally:
        hvd.remove_process_set(pair)
