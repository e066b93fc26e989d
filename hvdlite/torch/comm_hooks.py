"""Communication hooks for DistributedOptimizer's gradient buckets (DDP's GradBucket protocol), compression= as a
hook, and the one compressed-reduction path of both torch optimizers (``start_reduction``)."""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from hvdlite.core import ProcessSet
from hvdlite.core.frontend import accumulation_of, resolve_op

from .async_ops import Average, _allreduce, grouped_allreduce_async_, grouped_reducescatter_async
from .buckets import Bucket
from .compression import Compression

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "bf16_fp32acc_compress_hook",
           "fp16_fp32acc_compress_hook", "compression_hook",
           "Reduction", "start_reduction", "decompressed", "write_back"]

#: hook(state, bucket) -> anything with .wait() returning the reduced, averaged flat tensor
CommHook = Callable[[Any, "GradBucket"], Any]


class GradBucket:
    """One bucket of gradients as a hook sees it (torch.distributed.GradBucket's method names)."""

    def __init__(self, index: int, bucket: Bucket, last: bool, process_set: ProcessSet) -> None:
        self._index = index
        self._bucket = bucket
        self._last = last
        self.process_set = process_set
        #: stable and unique per bucket: the prefix of the names of the collectives a hook submits
        self.name = bucket.name
        assert bucket.grads is not None
        self._buffer = bucket.grads

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat, contiguous 1-D tensor holding the bucket's gradients (they are views of it)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.grad_views())

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass (every bucket runs once per step)."""
        return self._last

    def __repr__(self) -> str:
        return f"GradBucket({self.name}, index {self._index}, {self._buffer.numel()} elements)"


class Reduction(NamedTuple):
    """One started reduction of (compressed) tensors: its handle, and what decompressed() needs afterwards."""

    handle: Any
    ctxs: list[Any]
    compression: Any
    results: Optional[list[torch.Tensor]]  # where the reduced wires are once done (None: the handle's result)

    def wait(self) -> Any:
        return self.handle.wait()


def start_reduction(tensors: list[torch.Tensor], compression: Any, name: str, op: Any, prescale: float,
                    postscale: float, process_set: ProcessSet, *,
                    scatter_into: Optional[list[torch.Tensor]] = None) -> Reduction:
    """Compress each tensor and start one grouped reduction of the wires (the torch optimizers' one reduction
    path): an in-place allreduce, or with ``scatter_into`` (one output row per tensor, written directly when
    nothing is cast) a reducescatter."""
    pairs = [compression.compress(t) for t in tensors]
    wires = [w for w, _ in pairs]
    ctxs = [c for _, c in pairs]
    if scatter_into is None:
        handle = grouped_allreduce_async_(wires, name=name, op=op, prescale_factor=prescale,
                                          postscale_factor=postscale, process_set=process_set,
                                          accumulation=accumulation_of(compression))
        return Reduction(handle, ctxs, compression, wires)
    direct = all(w is t for w, t in zip(wires, tensors))  # nothing cast: reduce into the given rows
    handle = grouped_reducescatter_async(wires, name=name, op=op, process_set=process_set,
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         outputs=scatter_into if direct else None)
    return Reduction(handle, ctxs, compression, scatter_into if direct else None)


def decompressed(reduction: Reduction) -> Iterator[torch.Tensor]:
    """Once its handle is done (waited for by the caller): each tensor's reduced value, decompressed (the wire
    itself when not cast); one at a time, so that each temporary can go once written back."""
    results = reduction.results if reduction.results is not None else reduction.wait()
    return (reduction.compression.decompress(w, c) for w, c in zip(results, reduction.ctxs))


def write_back(target: torch.Tensor, result: torch.Tensor) -> None:
    """Put a reduced value into ``target`` unless it already is ``target``'s memory (reduced in place)."""
    if result is not target and result.data_ptr() != target.data_ptr():
        target.copy_(result.reshape(target.shape))


def compression_hook(compression: Any, op: Any, prescale: float, postscale: float) -> CommHook:
    """DistributedOptimizer's ``compression=``, ``op`` and ``gradient_predivide_factor`` as one hook: the
    built-in casts compress the whole bucket, any other compressor each gradient with its own shape (as Horovod
    hands it one tensor at a time); none, or an accumulating one (the engine casts), reduces in place."""
    accumulation = accumulation_of(compression)
    reduce_op = resolve_op(op)  # once, not per bucket and step

    def reduce(state: Any, bucket: GradBucket) -> Any:
        buffer = bucket.buffer()
        if compression is Compression.none or accumulation is not None:
            return _allreduce(buffer, bucket.name, reduce_op, prescale, postscale, bucket.process_set, True,
                              accumulation)
        whole = compression in (Compression.fp16, Compression.bf16)
        grads = [buffer] if whole else bucket.gradients()
        started = start_reduction(grads, compression, bucket.name, op, prescale, postscale, bucket.process_set)

        def back(_: Any) -> torch.Tensor:
            for grad, out in zip(grads, decompressed(started)):
                write_back(grad, out)
            return buffer
        return started.handle.then(back)
    return reduce


def _averaging(compression: Any, name: str, doc: str) -> CommHook:
    """A built-in hook: average the bucket through ``compression``."""
    hook = compression_hook(compression, Average, 1.0, 1.0)
    for attribute, value in (("__name__", name), ("__qualname__", name), ("__doc__", doc)):
        setattr(hook, attribute, value)
    return hook


allreduce_hook = _averaging(Compression.none, "allreduce_hook", "Average the bucket over its process set, in "
                            "place (the default).")
fp16_compress_hook = _averaging(Compression.fp16, "fp16_compress_hook", "Average the bucket sent as float16 (half "
                                "the bytes; range up to 65504), then cast back.")
bf16_compress_hook = _averaging(Compression.bf16, "bf16_compress_hook", "Average the bucket sent as bfloat16 (half "
                                "the bytes; float32's range, 8 bits of mantissa).")
bf16_fp32acc_compress_hook = _averaging(Compression.bf16_fp32acc, "bf16_fp32acc_compress_hook", "Average the bucket "
                                        "sent as bfloat16 and summed in float32 (one rounding of the average).")
fp16_fp32acc_compress_hook = _averaging(Compression.fp16_fp32acc, "fp16_fp32acc_compress_hook", "Average the "
                                        "bucket sent as float16 and summed in float32.")
