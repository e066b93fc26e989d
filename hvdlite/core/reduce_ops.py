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

    def __str__(self) -> str:
        return self.value

    __hash__ = object.__hash__  # members are singletons: hashed by identity, in C (see engine/requests.py's Kind)


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_BY_NAME = {member.value.lower(): member for member in ReduceOp}
_DTYPE_NAMES: dict[Any, Any] = {}

#: dtype names a collective accepts; "bfloat16" travels as uint16 bits.
SUPPORTED_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                    "float16", "bfloat16", "float32", "float64", "bool")
HALF_DTYPES = ("float16", "bfloat16")
#: the floating-point dtypes: Adasum's, and those an accumulating compression sums in float32
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def resolve_op(op: Any, average: bool | None = None) -> ReduceOp:
    """``op=`` (or Horovod's deprecated ``average=``) as a ReduceOp."""
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in _BY_NAME:
        return _BY_NAME[op.lower()]
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


def bf16_to_f32(bits: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """bfloat16 values (uint16 bits) as float32, exact; into ``out`` (float32) when given."""
    if out is None:
        out = np.empty(np.shape(bits), dtype=np.float32)
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def f32_to_bf16(values: np.ndarray, scratch: bool = False) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as uint16 bits; ``scratch``: ``values`` is the
    caller's own temporary, which the rounding may overwrite (no whole-buffer temporaries)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    nan = np.isnan(values)  # before the rounding below, which can carry a NaN's bits into infinity
    bits = values.view(np.uint32)
    work = bits if scratch else bits.copy()
    carry = np.right_shift(bits, 16)
    np.bitwise_and(carry, 1, out=carry)
    carry += 0x7FFF  # round half to even: 0x7FFF, plus 1 where the kept part is odd
    work += carry
    np.right_shift(work, 16, out=work)
    out = work.astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


#: The numpy ufunc that combines two operands of each op (Average adds; the division comes after).
NUMPY_REDUCTION: dict[ReduceOp, Callable[..., Any]] = {
    Sum: np.add, Average: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply,
}


def check_reduction(kind: str, name: str, op: ReduceOp, dtypes: Any, scaled: bool = False,
                    set_size: int | None = None) -> None:
    """Refuse, at submit, a reduction that cannot run: one check for every frontend and collective."""
    if op is ReduceOp.ADASUM:
        if kind != "allreduce":
            raise NotImplementedError(f"{kind} {name!r}: hvd.Adasum is only defined for allreduce; use "
                                      f"hvd.Sum or hvd.Average")
        bad = sorted({d for d in dtypes if d not in FLOAT_DTYPES})
        if bad:
            raise TypeError(f"{kind} {name!r}: hvd.Adasum needs floating-point tensors "
                            f"({', '.join(FLOAT_DTYPES)}), got {', '.join(bad)}")
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
    """bf16/fp16 on the wire, sums in float32 (engine/deterministic.py): contributions are cast to ``wire`` once,
    each slice's float32 sum rounded once to ``gather``, the dtype the slices are all-gathered in."""

    wire: str  # "bfloat16" or "float16"
    gather: str  # the wire dtype, or "float32"


def check_accumulation(kind: str, name: str, op: ReduceOp, dtypes: Any, accumulation: Optional[Accumulation],
                       rank: int) -> None:
    """Refuse, at submit, an accumulating compression the engine cannot run (one check for every frontend)."""
    if accumulation is None:
        return
    where = f"rank {rank}: "
    if kind != "allreduce":
        raise NotImplementedError(f"{where}{kind} {name!r}: float32 accumulation (Compression.*_fp32acc) is "
                                  f"defined for allreduce only; use Compression.bf16 or Compression.none")
    if not isinstance(accumulation, Accumulation) or accumulation.wire not in HALF_DTYPES \
            or accumulation.gather not in (accumulation.wire, "float32"):
        raise TypeError(f"{where}{kind} {name!r}: unsupported accumulating compression {accumulation!r}: the "
                        f"wire dtype must be one of {', '.join(HALF_DTYPES)} and the gather dtype the wire "
                        f"dtype or float32")
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(
            f"{where}{kind} {name!r}: float32 accumulation (Compression.*_fp32acc) sums; {op!r} has nothing "
            f"to accumulate: hvd.Min and hvd.Max of half-precision values are exact in half precision (use "
            f"Compression.bf16/fp16, which reduce them exactly), hvd.Product and hvd.Adasum are not sums. "
            f"Use op=hvd.Average or hvd.Sum, or another compression")
    unsupported = sorted({d for d in dtypes if d not in SUPPORTED_DTYPES or d == "bool"})
    if unsupported:
        raise TypeError(f"{where}{kind} {name!r}: float32 accumulation cannot carry {', '.join(unsupported)} "
                        f"tensors; floating-point ones ({', '.join(FLOAT_DTYPES)}) travel as "
                        f"{accumulation.wire}, integer ones reduce exactly as they are")


class Scale(float):
    """The postscale factor of an Average: ``float(Scale(f, n)) == f / n`` (the factor Horovod multiplies by),
    remembering ``n`` so that a plain Average of integers divides exactly: Horovod's ``trunc(s * (1/n))`` turns
    an exact quotient into the integer below where the product rounds under it (``49 * (1/49)`` gives 0);
    ``trunc(s / n)`` agrees with it at every size Horovod's tests run."""

    factor: float
    divisor: int

    def __new__(cls, factor: float, divisor: int = 1) -> "Scale":
        obj = super().__new__(cls, float(factor) / divisor)
        obj.factor = float(factor)
        obj.divisor = int(divisor)
        return obj


def exact_divisor(factor: float) -> int:
    """The divisor of a plain Average (no user postscale factor), else 1 (then integers are multiplied)."""
    return factor.divisor if isinstance(factor, Scale) and factor.factor == 1.0 else 1


def scale_inplace(values: np.ndarray, dtype: str, factor: float) -> None:
    """Multiply ``values`` (storage of dtype ``dtype``) by ``factor`` in place, rounded as Horovod's CPU
    ScaleBuffer: float16/32 by the float32 factor in float32, float64 in double, integers in float64 truncated;
    a plain Average (see Scale) divides by the set size instead, as Horovod's own tests expect (``t / size``)."""
    scaled_copy(values, values, dtype, factor)


def scaled_copy(dst: np.ndarray, src: np.ndarray, dtype: str, factor: float) -> None:
    """``dst[...] = src * factor`` with scale_inplace's rounding, in one pass where the dtype allows it."""
    if factor == 1.0:
        if dst is not src:
            np.copyto(dst, src, casting="no")
        return
    divisor = exact_divisor(factor)  # a plain Average's: x / n, correctly rounded (Horovod's tests' t / s)
    if dtype == "float16":  # in float32, rounded once to float16
        single = src.astype(np.float32)
        np.copyto(dst, single / np.float32(divisor) if divisor != 1 else single * np.float32(float(factor)),
                  casting="unsafe")
    elif dtype in ("float32", "float64") and divisor & (divisor - 1):  # n not a power of two
        np.divide(src, dst.dtype.type(divisor), out=dst)
    elif dtype in ("float32", "float64"):  # by the factor rounded to the dtype; 1/n for n a power of two is exact,
        # so x * (1/n) is x / n bit for bit, and numpy's multiply takes 0.57x its divide (benchmarks/HISTORY.md)
        np.multiply(src, dst.dtype.type(float(factor)), out=dst)
    elif dtype == "bfloat16":
        dst[...] = f32_to_bf16(bf16_to_f32(src) * np.float32(float(factor)))
    elif dtype == "bool":
        raise TypeError("scale factors are not defined for bool tensors")
    else:  # integers: trunc(double(src) * factor), a C cast as Horovod's ScaleBuffer; a plain Average: / n
        wide = src / np.float64(divisor) if divisor != 1 else src * np.float64(float(factor))
        np.copyto(dst, np.trunc(wide), casting="unsafe")
