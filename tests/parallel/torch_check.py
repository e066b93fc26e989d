"""Helpers of the in-rank torch tests: deterministic per-rank inputs, exact comparison, gradient checks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

import hvdlite.torch as hvd

R, N = hvd.rank(), hvd.size()


def base(r: int, shape: tuple = (3, 4), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank r's deterministic input: small integers, exact in every dtype."""
    g = torch.Generator().manual_seed(100 + r)
    return torch.randint(0, 5, shape, generator=g).to(dtype)


def same(a: Any, b: Any, what: str, tol: float = 0.0) -> None:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert diff <= tol, f"{what}: max difference {diff} > {tol}\n{a}\n{b}"


# Gradients: rank r backpropagates sum_k(out_k * up(r, out_k.shape, k)), so up(r, ...) is the upstream
# gradient of its k-th output; every expected input gradient is Horovod's formula applied to all ranks' up().
def up(r: int, shape: tuple, k: int = 0) -> torch.Tensor:
    """Rank r's upstream gradient for output k: integers 1..4 (positive, so sums never cancel to 0)."""
    return torch.randint(1, 5, shape, generator=torch.Generator().manual_seed(1000 + 10 * r + k)).double()


def ups(shape: tuple, k: int = 0, ranks: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Every rank's (or ``ranks``') upstream gradient, stacked along a new dimension 0."""
    return torch.stack([up(r, shape, k) for r in (range(N) if ranks is None else ranks)])


def grad_of(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> torch.Tensor:
    """This rank's input gradient through the collective(s) in ``fn``."""
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    sum((o * up(R, o.shape, k)).sum() for k, o in enumerate(outs)).backward()
    return x.grad


def check(what: str, fn: Callable[[torch.Tensor], Any], x: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact up to float64 rounding of the division by the set size (the old conventions differ by >= 1/3)."""
    same(grad_of(fn, x), expected, f"gradient of {what}", tol=1e-12)
