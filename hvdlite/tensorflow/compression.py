"""Gradient compression for the TensorFlow frontend: ``Compression.none``, ``.fp16`` and ``.bf16``, the
core's one algorithm (``hvdlite.core.frontend.CastCompressor``) with TensorFlow's cast; and ``bf16_fp32acc``,
``fp16_fp32acc``, ``bf16_fp32acc_fp32gather`` (half precision on the wire, float32 sums), as hvdlite.torch's."""
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
    """Sends floating-point tensors as bfloat16 (float32's range, fewer mantissa bits) and casts the result
    back to their dtype; the same as hvdlite.torch's ``Compression.bf16``."""

    wire_dtype = tf.bfloat16


class Compression:
    """The compression algorithms an allreduce may use (Horovod's names, plus ``bf16`` and the float32-
    accumulating ones as in hvdlite.torch: docs/torch.md says when to use them)."""

    none, fp16, bf16 = NoneCompressor, FP16Compressor, BF16Compressor
    bf16_fp32acc, fp16_fp32acc = accumulating("bfloat16"), accumulating("float16")
    bf16_fp32acc_fp32gather = accumulating("bfloat16", "float32")
