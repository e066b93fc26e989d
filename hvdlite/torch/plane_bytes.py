"""Byte views and in-place scaling of torch tensors, as the torch data planes move and scale them."""
from __future__ import annotations

import math

import torch

from hvdlite.core.frontend import exact_divisor

__all__ = ["as_bytes", "row_bytes", "scale_in_place"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def scale_in_place(t: torch.Tensor, factor: float) -> None:
    """Multiply in place with the MPI path's rounding (hvdlite.core.reduce_ops.scale_inplace): float32 and
    half precision by the factor rounded to float32, in float32; float64 in double; integers in float64,
    truncated toward zero; a plain Average divides by the set size."""
    if factor == 1.0 or t.numel() == 0:
        return
    divisor = exact_divisor(factor)
    if divisor != 1 and t.dtype.is_floating_point:  # a plain Average divides (as scale_inplace)
        if t.dtype in (torch.float16, torch.bfloat16):
            t.copy_(t.float() / divisor)
        else:
            t.div_(divisor)
    elif t.dtype in (torch.float16, torch.bfloat16, torch.float32):
        wide = t.float()
        wide *= torch.tensor(float(factor), dtype=torch.float32, device=t.device)
        t.copy_(wide)
    elif t.dtype.is_floating_point:
        t.mul_(float(factor))
    else:
        wide = t.double()
        if divisor != 1:
            wide /= divisor
        else:
            wide *= float(factor)
        t.copy_(wide.trunc())
