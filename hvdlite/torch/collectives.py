"""horovod.torch's synchronous collectives as autograd Functions, with Horovod's backward conventions (each
class says its own; docs/torch.md states them all)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core import rank as core_rank
from hvdlite.core.frontend import Accumulation, accumulation_of, resolve_op

from .compression import Compression
from .tensors import check_dtype, check_tensors
from .async_ops import (Average, Sum, allgather_async, alltoall_async, broadcast_async, grouped_allgather_async,
                      grouped_allreduce_async, grouped_reducescatter_async, synchronize)


def _allreduce_grads(grads: Sequence[torch.Tensor], op: Any, scales: tuple[float, float],
                     process_set: ProcessSet, accumulation: Optional[Accumulation] = None) -> list[torch.Tensor]:
    """Horovod's allreduce backward: the forward's reduction, scale factors and set, applied to the gradients."""
    return synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=op, prescale_factor=scales[0],
                                               postscale_factor=scales[1], process_set=process_set,
                                               accumulation=accumulation))


def _backward(ctx: Any, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(_allreduce_grads(grads, ctx.op, ctx.scales, ctx.process_set, ctx.accumulation))


class HorovodAllreduce(torch.autograd.Function):
    """Differentiable allreduce of one tensor (``accumulation``: an accumulating compression's)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Any,
                prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                accumulation: Optional[Accumulation] = None) -> torch.Tensor:
        return _grouped_forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                                accumulation, [tensor])[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _backward(ctx, [grad]) + (None,) * 7


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Differentiable allreduce of a list of tensors as one unit (Horovod's signature)."""

    @staticmethod
    def forward(ctx: Any, average: Optional[bool], name: Optional[str], op: Any, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        return _grouped_forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, None,
                                tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None,) * 6 + _backward(ctx, grads)


class AccumulatedGroupedAllreduce(torch.autograd.Function):
    """HorovodGroupedAllreduce with an accumulating compression's ``accumulation`` (before the tensors)."""

    @staticmethod
    def forward(ctx: Any, average: Optional[bool], name: Optional[str], op: Any, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet, accumulation: Optional[Accumulation],
                *tensors: torch.Tensor) -> tuple:
        return _grouped_forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                                accumulation, tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None,) * 7 + _backward(ctx, grads)


def _grouped_forward(ctx: Any, average: Optional[bool], name: Optional[str], op: Any, pre: float, post: float,
                     process_set: ProcessSet, accumulation: Optional[Accumulation], tensors: Sequence[torch.Tensor],
                     ) -> tuple:
    ctx.op, ctx.scales, ctx.process_set, ctx.accumulation = resolve_op(op, average), (pre, post), process_set, \
        accumulation
    return tuple(synchronize(grouped_allreduce_async(tensors, average, name, op, pre, post, process_set,
                                                     accumulation=accumulation)))


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather: backward averages the gradients over the set and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], process_set: ProcessSet) -> torch.Tensor:
        ctx.shapes, ctx.process_set = [tensor.shape], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (_allgather_grads([grad], ctx.shapes, ctx.process_set)[0], None, None)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: Optional[str], process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return (None, None) + tuple(_allgather_grads(list(grads), ctx.shapes, ctx.process_set))


def _allgather_grads(grads: list[torch.Tensor], shapes: list[torch.Size],
                     process_set: ProcessSet) -> list[torch.Tensor]:
    """Average the gathered tensors' gradients over the set (Horovod's convention); keep this rank's rows."""
    rows = [shape[0] if len(shape) else 1 for shape in shapes]
    averaged = _allreduce_grads(grads, Average, (1.0, 1.0), process_set)
    all_rows = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), process_set=process_set))
    offsets = all_rows[:process_set.rank()].sum(dim=0).tolist()
    return [a.narrow(0, int(o), n).reshape(shape) for a, o, n, shape in zip(averaged, offsets, rows, shapes)]


class HorovodBroadcast(torch.autograd.Function):
    """Differentiable broadcast: the root receives the set's average gradient, the other ranks zeros."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = _allreduce_grads([grad], Average, (1.0, 1.0), ctx.process_set)[0]
        if core_rank() != ctx.root_rank:  # root_rank is a rank of the whole job, as in the forward
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """Differentiable alltoall: backward sends each gradient row back where its input row came from."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str], process_set: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple:
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, process_set=ctx.process_set))
        return back, None, None, None


class HorovodReducescatter(torch.autograd.Function):
    """Differentiable reducescatter: backward allgathers the gradients (times the set size for Sum)."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: Any, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> tuple:
        ctx.op = resolve_op(op)
        ctx.scale, ctx.process_set = prescale_factor * postscale_factor, process_set
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                             postscale_factor)))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # Horovod's convention: Sum's gradient is scaled by the set size, every op's by the scale factors.
        factor = ctx.scale * (ctx.process_set.size() if ctx.op is Sum else 1)
        scaled = [(g * factor if factor != 1.0 else g).contiguous() for g in grads]
        gathered = synchronize(grouped_allgather_async(scaled, process_set=ctx.process_set))
        return (None,) * 5 + tuple(gathered)


# -- the public synchronous functions -----------------------------------------------------------------
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (Average by default); differentiable; the input is unmodified."""
    check_dtype(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set,
                                 accumulation_of(compression))
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one unit; differentiable; returns new tensors."""
    pairs = [compression.compress(t) for t in check_tensors(tensors, "grouped_allreduce")]
    outs = AccumulatedGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                             accumulation_of(compression), *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dimension 0 (sizes may differ); differentiable."""
    check_dtype(tensor, "allgather")
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return list(HorovodGroupedAllgather.apply(name, process_set, *check_tensors(tensors, "grouped_allgather")))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A copy of root_rank's ``tensor`` on every rank; differentiable; the input is unmodified."""
    check_dtype(tensor, "broadcast")
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter rows to every rank and gather theirs; returns (tensor, received_splits) when splits is
    given, else the tensor alone (Horovod's convention); differentiable."""
    check_dtype(tensor, "alltoall")
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` and keep this rank's share of dimension 0 (earlier ranks take the remainder)."""
    check_dtype(tensor, "reducescatter")
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    pairs = [compression.compress(t) for t in check_tensors(tensors, "grouped_reducescatter")]
    outs = HorovodReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                      *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]
