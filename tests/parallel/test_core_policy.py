"""The policy frontends share, tested on the core's numpy arrays: sparse gradients combined by allgather."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.core.frontend import sparse_allgather_async
from hvdlite.core.reduce_ops import bf16_to_f32, f32_to_bf16

MPI_SIZES = (2, 3)


def rows(rank: int) -> tuple[np.ndarray, np.ndarray]:
    indices = np.array([[rank], [rank + 1]], dtype=np.int64)
    values = np.array([[2.0 * rank, 1.0], [6.0, 3.0 * rank]])
    return indices, values


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
def test_sparse_rows_are_gathered_and_averaged(rank: int, size: int, op) -> None:
    indices, values = rows(rank)
    got_i, got_v = hvd.synchronize(sparse_allgather_async(indices, values, op, name=f"sp.{op.value}"))
    want_i = np.concatenate([rows(r)[0] for r in range(size)])
    want_v = np.concatenate([rows(r)[1] for r in range(size)]) / (size if op is hvd.Average else 1)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_v, want_v)


def test_sparse_average_of_bfloat16_divides_values_not_bits(rank: int, size: int) -> None:
    indices, values = rows(rank)
    bits = f32_to_bf16(values.astype(np.float32))
    _, got = hvd.synchronize(sparse_allgather_async(indices, bits, hvd.Average, name="sp.bf16",
                                                    values_dtype_hint="bfloat16"))
    want = np.concatenate([rows(r)[1] for r in range(size)]).astype(np.float32) / size
    np.testing.assert_allclose(bf16_to_f32(got), want, rtol=1e-2)


def test_sparse_average_of_integers_is_true_division(rank: int, size: int) -> None:
    indices = np.array([[rank]], dtype=np.int64)
    values = np.array([[rank + 1]], dtype=np.int64)
    _, got = hvd.synchronize(sparse_allgather_async(indices, values, hvd.Average, name="sp.int"))
    np.testing.assert_array_equal(got, np.arange(1, size + 1).reshape(-1, 1) / size)


def test_sparse_refusals(rank: int) -> None:
    idx, val = rows(rank)
    with pytest.raises(ValueError, match="only hvd.Average and hvd.Sum are defined for sparse tensors"):
        sparse_allgather_async(idx, val, hvd.Max, name="sp.max")
    with pytest.raises(NotImplementedError, match="hvd.Adasum does not support sparse tensors"):
        sparse_allgather_async(idx, val, hvd.Adasum, name="sp.adasum")
