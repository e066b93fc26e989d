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

    #: none (the default) and fp16 are Horovod's; bf16 and the float32-accumulating casts (Sum and Average only)
    #: are hvdlite's: docs/torch.md says what each rounds and when to use it.
    none, fp16, bf16 = NoneCompressor, FP16Compressor, BF16Compressor
    bf16_fp32acc, fp16_fp32acc = accumulating("bfloat16"), accumulating("float16")
    bf16_fp32acc_fp32gather = accumulating("bfloat16", "float32")
