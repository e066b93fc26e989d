"""Gradient compression's one algorithm for every frontend: cast floating-point tensors for the wire and back.

A frontend subclasses ``CastCompressor`` once with its framework's cast, then names the wire dtypes
(``fp16``, ``bf16``). ``compress`` returns ``(wire tensor, ctx)``: ``ctx`` is the original dtype when the
tensor was cast and None when it went as it was, so ``decompress`` casts back only what was cast.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["Compressor", "NoneCompressor", "CastCompressor"]


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: Any, ctx: Any = None) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default)."""

    @staticmethod
    def compress(tensor: Any, ctx: Any = None) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype`` for the wire, and the result back to their dtype.

    A frontend provides ``is_floating`` and ``cast`` for its framework's tensors (which have a ``dtype``)."""

    wire_dtype: Any = None

    @staticmethod
    def is_floating(dtype: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any, ctx: Any = None) -> tuple[Any, Optional[Any]]:
        dtype = tensor.dtype
        if cls.is_floating(dtype) and dtype != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Optional[Any]) -> Any:
        return tensor if ctx is None else cls.cast(tensor, ctx)
