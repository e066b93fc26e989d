"""Reduce operations and dtypes: op resolution, the checks every frontend shares, and scaling arithmetic."""
from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple, Optional

import numpy as np


class ReduceOp(enum.Enum):
    """A reduction, exported as ``hvd.Average``, ``hvd.Sum``, ... (the names Horovod uses)."""

    AVERAGE = "Average"
    SUM = "Sum"
    ADASUM = "Adasum"
    MIN = "Min"
    MAX = "Max"
    PRODUCT = "Product"

    def __repr__(self) -> str:
        return f"hvd.{self.value}"

    __hash__ = object.__hash__  # members are singletons: Enum's own hash is Python code, run per op

    def __str__(self) -> str:
        return self.value


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_BY_VALUE = {member.value: member for member in ReduceOp}
_DTYPE_NAMES: dict[Any, Any] = {}

#: dtype names a collective accepts; "bfloat16" travels as uint16 bits.
SUPPORTED_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                    "float16", "bfloat16", "float32", "float64", "bool")
HALF_DTYPES = ("float16", "bfloat16")
ADASUM_DTYPES = ("float16", "bfloat16", "float32", "float64")


def resolve_op(op: Any, average: bool | None = None) -> ReduceOp:
    """Turn ``op=`` (or Horovod's deprecated ``average=``) into a ReduceOp."""
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, ReduceOp):
        return op
    if op in _BY_VALUE:
        return _BY_VALUE[op]
    for member in ReduceOp:
        if op == member.value or (isinstance(op, str) and op.lower() == member.value.lower()):
            return member
    raise ValueError(f"unknown reduce op {op!r}; use one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, "
                     f"hvd.Product")


def dtype_name(array: np.ndarray, dtype_hint: str | None = None) -> str:
    """The canonical dtype name of an array, honouring a "bfloat16" hint for uint16 storage."""
    name = _DTYPE_NAMES.get(array.dtype)
    if name is None:
        name = _DTYPE_NAMES[array.dtype] = array.dtype.name
    if dtype_hint == "bfloat16" or name == "bfloat16":
        return "bfloat16"
    if name not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {name} is not supported by hvdlite collectives; supported: "
                        f"{', '.join(SUPPORTED_DTYPES)}")
    return name


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes carry values of dtype ``name``."""
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as uint16 bits."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


_NP_REDUCE: dict[ReduceOp, Callable[..., Any]] = {
    Sum: np.add, Average: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply,
}


def numpy_reduction(op: ReduceOp) -> Callable[..., Any]:
    """The numpy ufunc that combines two operands of ``op`` (Average adds; the division comes after)."""
    return _NP_REDUCE[op]


def check_reduction(kind: str, name: str, op: ReduceOp, dtypes: Any, scaled: bool = False,
                    set_size: int | None = None) -> None:
    """Refuse, at submit, a reduction that cannot run: one check for every frontend and collective."""
    if op is ReduceOp.ADASUM:
        if kind != "allreduce":
            raise NotImplementedError(f"{kind} {name!r}: hvd.Adasum is only defined for allreduce; use "
                                      f"hvd.Sum or hvd.Average")
        bad = sorted({d for d in dtypes if d not in ADASUM_DTYPES})
        if bad:
            raise TypeError(f"{kind} {name!r}: hvd.Adasum needs floating-point tensors "
                            f"({', '.join(ADASUM_DTYPES)}), got {', '.join(bad)}")
        if set_size is not None and (set_size & (set_size - 1)):
            raise ValueError(f"{kind} {name!r}: hvd.Adasum needs a power-of-two number of ranks in the "
                             f"process set (got {set_size}); use hvd.Average, or run on 2, 4, 8... ranks")
    for dtype in dtypes:
        if dtype == "bool" and op is ReduceOp.AVERAGE:
            raise TypeError(f"{kind} {name!r}: hvd.Average is not defined for bool tensors; use hvd.Sum "
                            f"(logical or), hvd.Min or hvd.Max")
        if dtype == "bool" and scaled:
            raise TypeError(f"{kind} {name!r}: prescale_factor/postscale_factor are not defined for bool "
                            f"tensors")


class Accumulation(NamedTuple):
    """bf16/fp16 on the wire, sums in float32: how an allreduce with an accumulating compression reduces its
    floating-point tensors (engine/accumulate.py). Each rank casts its contribution to ``wire`` once; the
    rank owning a slice adds every rank's contribution to it in float32, in rank order, scales it, and rounds
    it once to ``gather``, the dtype the slices are all-gathered in (``wire``, or "float32" for the exact
    float32 result at twice the gather's bytes). Integer and bool tensors of the same op reduce as always."""

    wire: str  # "bfloat16" or "float16"
    gather: str  # the wire dtype, or "float32"


ACCUMULATED_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE)


def check_accumulation(kind: str, name: str, op: ReduceOp, dtypes: Any, accumulation: Optional[Accumulation],
                       rank: Optional[int] = None) -> None:
    """Refuse, at submit, an accumulating compression the engine cannot run (one check for every frontend)."""
    if accumulation is None:
        return
    where = f"rank {rank}: " if rank is not None else ""
    if kind != "allreduce":
        raise NotImplementedError(f"{where}{kind} {name!r}: float32 accumulation (Compression.*_fp32acc) is "
                                  f"defined for allreduce only; use Compression.bf16 or Compression.none")
    if not isinstance(accumulation, Accumulation) or accumulation.wire not in HALF_DTYPES \
            or accumulation.gather not in (accumulation.wire, "float32"):
        raise TypeError(f"{where}{kind} {name!r}: unsupported accumulating compression {accumulation!r}: the "
                        f"wire dtype must be one of {', '.join(HALF_DTYPES)} and the gather dtype the wire "
                        f"dtype or float32")
    if op not in ACCUMULATED_OPS:
        raise ValueError(
            f"{where}{kind} {name!r}: float32 accumulation (Compression.*_fp32acc) sums; {op!r} has nothing "
            f"to accumulate: hvd.Min and hvd.Max of half-precision values are exact in half precision (use "
            f"Compression.bf16/fp16, which reduce them exactly), hvd.Product and hvd.Adasum are not sums. "
            f"Use op=hvd.Average or hvd.Sum, or another compression")
    unsupported = sorted({d for d in dtypes if d not in ACCUMULABLE_DTYPES and d not in PASSED_DTYPES})
    if unsupported:
        raise TypeError(f"{where}{kind} {name!r}: float32 accumulation cannot carry {', '.join(unsupported)} "
                        f"tensors; floating-point ones ({', '.join(ACCUMULABLE_DTYPES)}) travel as "
                        f"{accumulation.wire}, integer ones reduce exactly as they are")


#: dtypes an accumulating compression sends in its wire dtype and sums in float32
ACCUMULABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: dtypes it leaves alone: integers reduce exactly in any order (bool has no sum to accumulate)
PASSED_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")


class Scale(float):
    """A scale factor that remembers an exact divisor, so Average divides integers exactly.

    ``float(Scale(f, n)) == f / n``; integer tensors are scaled as ``x * f / n`` in float64 (a true
    division, exact wherever the quotient is), where ``x * (1 / n)`` would truncate 49 * (1/49) to 0.
    """

    factor: float
    divisor: int

    def __new__(cls, factor: float, divisor: int = 1) -> "Scale":
        obj = super().__new__(cls, float(factor) / divisor)
        obj.factor = float(factor)
        obj.divisor = int(divisor)
        return obj


def average_scale(postscale: float, nranks: int) -> Scale:
    """The postscale factor of an Average over ``nranks`` ranks: the user's factor, then / nranks."""
    return Scale(postscale, nranks)


def _f64_scaled(values: np.ndarray, factor: float) -> np.ndarray:
    """``values * factor`` in float64, Average's divisor applied as a true division."""
    out = values.astype(np.float64)
    if isinstance(factor, Scale):
        if out.size and factor.factor != 1.0:
            out *= factor.factor
        if factor.divisor != 1:
            out /= factor.divisor
    else:
        out *= float(factor)
    return out


def _scale_float(dst: np.ndarray, src: np.ndarray, factor: float) -> None:
    """``dst[...] = src * factor`` for float32/float64 as Horovod rounds it: by a double factor, so each
    element is ``float32(double(x) * factor)``. For float32 three ways give that value bit for bit:
    - a factor exact in float32 (1/2, 1/4, 2...): the float32 product is that value (float32 speed);
    - Average over an odd number n of ranks (factor 1/n): float32's correctly rounded ``x / n``. A float32
      quotient x/n never lies on, or within 2**-52 of, a rounding midpoint of float32 (that would need x to
      have more than 24 significant bits), so rounding the double product first cannot change the result;
    - otherwise numpy multiplies float32 by a float64 scalar in float64, chunk by chunk through its small cast
      buffers (no whole-buffer temporary), rounding into the float32 output: about 5 times the cost of a
      float32 multiply, so only for factors such as a user's 0.1 or an even n that is not a power of two."""
    f = float(factor)
    if dst.dtype == np.float32:
        if float(np.float32(f)) == f:
            np.multiply(src, np.float32(f), out=dst)
            return
        if isinstance(factor, Scale) and factor.factor == 1.0 and factor.divisor % 2 == 1 \
                and factor.divisor < 1 << 24:
            np.divide(src, np.float32(factor.divisor), out=dst)
            return
    np.multiply(src, np.float64(f), out=dst)


def scale_inplace(values: np.ndarray, dtype: str, factor: float) -> None:
    """Multiply ``values`` (storage of dtype ``dtype``) by ``factor`` in place, with Horovod's
    precision: half precision in float32, float32/float64 by a double factor (one rounding of the double
    product), integers in float64 (truncated toward zero, as a C cast)."""
    if factor == 1.0:
        return
    if dtype == "bfloat16":
        values[...] = f32_to_bf16(bf16_to_f32(values) * np.float32(factor))
    elif dtype == "bool":
        raise TypeError("scale factors are not defined for bool tensors")
    elif dtype == "float16":
        np.copyto(values, values.astype(np.float32) * np.float32(factor), casting="unsafe")
    elif values.dtype.kind in "iu":
        np.copyto(values, np.trunc(_f64_scaled(values, factor)), casting="unsafe")
    else:
        _scale_float(values, values, factor)


def scaled_copy(dst: np.ndarray, src: np.ndarray, dtype: str, factor: float) -> None:
    """``dst[...] = src * factor`` with one pass over memory where the dtype allows it."""
    if factor == 1.0:
        np.copyto(dst, src, casting="no")
    elif dtype in ("float32", "float64"):
        _scale_float(dst, src, factor)
    elif dtype == "float16":
        np.copyto(dst, src.astype(np.float32) * np.float32(factor), casting="unsafe")
    else:
        np.copyto(dst, src, casting="no")
        scale_inplace(dst, dtype, factor)
