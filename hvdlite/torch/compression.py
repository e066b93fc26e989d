"""Gradient compression for allreduce: none, fp16 (as Horovod), bf16, and bf16/fp16 on the wire with float32
sums (hvdlite additions); the algorithms are the core's, the casts torch's."""
from __future__ import annotations

import torch

from hvdlite.core.frontend import CastCompressor, Compressor, NoneCompressor, accumulating

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TorchCast(CastCompressor):
    is_floating = staticmethod(lambda dtype: bool(dtype.is_floating_point))
    cast = staticmethod(lambda tensor, dtype: tensor.to(dtype))


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
    #: Cast floating-point tensors to bfloat16 for the allreduce (not in Horovod). The reduction itself runs
    #: in bfloat16: one rounding per addition, an error that grows with the number of ranks.
    bf16 = BF16Compressor
    #: bfloat16 on the wire (half the bytes), float32 sums: each rank adds its slice of every rank's bfloat16
    #: contribution in float32 in rank order and rounds once; the result is all-gathered in bfloat16. Sum and
    #: Average only (not in Horovod; docs/torch.md says when to use it).
    bf16_fp32acc = accumulating("bfloat16")
    #: As bf16_fp32acc with float16 on the wire (10 mantissa bits, range up to 65504).
    fp16_fp32acc = accumulating("float16")
    #: As bf16_fp32acc, with the float32 sums all-gathered in float32 (no final rounding to bfloat16; the
    #: gather moves twice the bytes: 3/4 of an fp32 allreduce's traffic instead of 1/2).
    bf16_fp32acc_fp32gather = accumulating("bfloat16", "float32")
