"""Gradient compression's one algorithm for every frontend: cast floating-point tensors for the wire and back."""
from __future__ import annotations

from typing import Any, Optional

from .reduce_ops import Accumulation


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
    """Casts floating-point tensors to ``wire_dtype`` for the wire, and the result back (``ctx``: the dtype it
    had, None when it went as it was); a frontend provides ``is_floating`` and ``cast``."""

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


class AccumulatingCompressor(NoneCompressor):
    """Half precision on the wire, float32 sums (``bf16_fp32acc``...): the tensor goes to the allreduce as it is,
    with ``accumulation`` for the engine (core/engine/deterministic.py)."""

    accumulation: Accumulation = Accumulation("bfloat16", "bfloat16")


_ACCUMULATING: dict[Accumulation, type[AccumulatingCompressor]] = {}


def accumulating(wire: str, gather: Optional[str] = None) -> type[AccumulatingCompressor]:
    """The accumulating compressor of ``wire`` ("bfloat16"/"float16") and ``gather`` (default: the wire dtype, or
    "float32"); one class per pair, shared by both frontends."""
    acc = Accumulation(wire, wire if gather is None else gather)
    found = _ACCUMULATING.get(acc)
    if found is None:
        short = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}
        label = f"{short[acc.wire]}FP32Acc" + ("" if acc.gather == acc.wire else "FP32Gather")
        found = _ACCUMULATING[acc] = type(f"{label}Compressor", (AccumulatingCompressor,), {
            "accumulation": acc, "__doc__": f"{acc.wire} on the wire, float32 sums, {acc.gather} result."})
    return found


def accumulation_of(compression: Any) -> Optional[Accumulation]:
    """What an allreduce with ``compression`` hands the engine: its Accumulation, or None (cast or none)."""
    acc = getattr(compression, "accumulation", None)
    return acc if isinstance(acc, Accumulation) else None


def check_sparse_compression(compression: Any, what: str, rank: int) -> None:
    """Refuse a sparse gradient (``what``) under an accumulating compression: sparse ones are allgathered."""
    if accumulation_of(compression) is not None:
        raise ValueError(f"rank {rank}: {what} is sparse, and sparse gradients are allgathered uncompressed; "
                         f"compression={getattr(compression, '__name__', compression)} sums dense tensors in "
                         f"float32. Pass sparse_as_dense=True to densify it (then it is compressed like the "
                         f"others), or use another compression")
