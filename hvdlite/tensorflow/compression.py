"""Gradient compression for the TensorFlow frontend: the core's algorithms, as hvdlite.torch's, with TF's cast."""
from __future__ import annotations

import tensorflow as tf

from hvdlite.core.frontend import CastCompressor, Compressor, NoneCompressor, accumulating

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _TensorFlowCast(CastCompressor):
    is_floating = staticmethod(lambda dtype: bool(dtype.is_floating))
    cast = staticmethod(tf.cast)


class FP16Compressor(_TensorFlowCast):
    """Sends floating-point tensors as float16 and casts the result back to their dtype."""

    wire_dtype = tf.float16


class BF16Compressor(_TensorFlowCast):
    """Sends floating-point tensors as bfloat16 (float32's range, fewer mantissa bits), as hvdlite.torch's."""

    wire_dtype = tf.bfloat16


class Compression:
    """Horovod's compression algorithms, plus ``bf16`` and the float32-accumulating ones (docs/torch.md)."""

    none, fp16, bf16 = NoneCompressor, FP16Compressor, BF16Compressor
    bf16_fp32acc, fp16_fp32acc = accumulating("bfloat16"), accumulating("float16")
    bf16_fp32acc_fp32gather = accumulating("bfloat16", "float32")
