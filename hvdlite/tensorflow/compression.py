"""Gradient compression for the TensorFlow frontend: ``Compression.none``, ``.fp16`` and ``.bf16``."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import tensorflow as tf


class Compressor:
    """Turns a tensor into what goes over the wire, and back (``ctx`` carries what is needed)."""

    @staticmethod
    def compress(tensor: tf.Tensor, ctx: Any = None) -> Tuple[tf.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged (the default)."""

    @staticmethod
    def compress(tensor: tf.Tensor, ctx: Any = None) -> Tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and casts the result back to their dtype."""

    @staticmethod
    def compress(tensor: tf.Tensor, ctx: Any = None) -> Tuple[tf.Tensor, Optional[tf.DType]]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Optional[tf.DType]) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class BF16Compressor(Compressor):
    """Sends floating-point tensors as bfloat16 (float32's range, fewer mantissa bits) and casts the result
    back to their dtype; the same as hvdlite.torch's ``Compression.bf16``."""

    @staticmethod
    def compress(tensor: tf.Tensor, ctx: Any = None) -> Tuple[tf.Tensor, Optional[tf.DType]]:
        if tensor.dtype.is_floating and tensor.dtype != tf.bfloat16:
            return tf.cast(tensor, tf.bfloat16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Optional[tf.DType]) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compression algorithms an allreduce may use (Horovod's names, plus ``bf16`` as in hvdlite.torch)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
