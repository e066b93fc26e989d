"""Gradient compression for allreduce: none, fp16 (as Horovod) and bf16 (an hvdlite addition).

The algorithm is the core's (``hvdlite.core.frontend.CastCompressor``); this module gives it torch's casts.
"""
from __future__ import annotations

from typing import Any

import torch

from hvdlite.core.frontend import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TorchCast(CastCompressor):
    @staticmethod
    def is_floating(dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
        return tensor.to(dtype)


class FP16Compressor(_TorchCast):
    """Sends floating-point tensors as float16 (halves the bytes; range up to 65504)."""

    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    """Sends floating-point tensors as bfloat16 (halves the bytes; float32's range, 8 bits of mantissa)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compression algorithms for ``compression=`` arguments."""

    #: No compression (the default).
    none = NoneCompressor
    #: Cast floating-point tensors to float16 for the allreduce.
    fp16 = FP16Compressor
    #: Cast floating-point tensors to bfloat16 for the allreduce (not in Horovod).
    bf16 = BF16Compressor
