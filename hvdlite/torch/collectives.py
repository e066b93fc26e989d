"""horovod.torch's synchronous collectives as autograd Functions, each with its exact backward.

Gradient convention: the gradient a rank receives for its input is the derivative of the *sum of
every rank's loss*, the same convention as allreduce's backward (and as DistributedOptimizer, which
then averages parameter gradients). Under it, allgather's and broadcast's backward sum the incoming
gradients across ranks, and reducescatter's backward is an allgather (divided by the set size for
Average). Horovod itself averages in allgather/broadcast and multiplies reducescatter-Sum by the
set size; docs/torch.md lists this difference.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from hvdlite.core import ProcessSet, global_process_set

from .compression import Compression
from .mpi_ops import (Average, Max, Min, Product, Sum, _op, allgather_async, alltoall_async, broadcast_async,
                      grouped_allgather_async, grouped_allreduce_async, grouped_reducescatter_async,
                      synchronize)


def _reduce_backward(grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                     outputs: Sequence[torch.Tensor], op: Any, pre: float, post: float,
                     process_set: ProcessSet) -> list[torch.Tensor]:
    """Gradients of y = post * OP_r(pre * x_r) with respect to this rank's x."""
    grads = [g.contiguous() for g in grads]
    if op in (Sum, Average):
        return synchronize(grouped_allreduce_async(grads, op=op, prescale_factor=pre, postscale_factor=post,
                                                   process_set=process_set))
    if op in (Min, Max):
        # The winner(s) of the min/max take the summed gradient; ties share it equally.
        masks = [((x * pre) * post == y).to(g.dtype) for x, y, g in zip(inputs, outputs, grads)]
        summed = synchronize(grouped_allreduce_async(grads + masks, op=Sum, process_set=process_set))
        k = len(grads)
        return [gs * m / cnt.clamp(min=1) * (pre * post)
                for gs, m, cnt in zip(summed[:k], masks, summed[k:])]
    # Product: d/dx_r of post * prod_i(pre * x_i) is post * pre^n * prod_{i != r} x_i (exact with zeros).
    gathered = synchronize(grouped_allgather_async([x.detach().unsqueeze(0) for x in inputs],
                                                   process_set=process_set))
    summed = synchronize(grouped_allreduce_async(grads, op=Sum, process_set=process_set))
    me, n = process_set.rank(), process_set.size()
    out = []
    for gs, rows in zip(summed, gathered):
        others = torch.cat([rows[:me], rows[me + 1:]])
        out.append(gs * others.prod(dim=0) * (post * pre ** n))
    return out


class HorovodAllreduce(torch.autograd.Function):
    """Differentiable allreduce of one tensor."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Optional[bool], name: Optional[str], op: Any,
                prescale_factor: float, postscale_factor: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op, ctx.scales, ctx.process_set = _op(op, average, "allreduce"), (prescale_factor,
                                                                                postscale_factor), process_set
        out = synchronize(grouped_allreduce_async([tensor], average, name, op, prescale_factor,
                                                  postscale_factor, process_set))[0]
        if ctx.op in (Min, Max, Product):
            ctx.save_for_backward(tensor, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors or (None, None)
        g = _reduce_backward([grad], [saved[0]], [saved[1]], ctx.op, *ctx.scales, ctx.process_set)[0]
        return (g,) + (None,) * 6


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Differentiable allreduce of a list of tensors as one unit."""

    @staticmethod
    def forward(ctx: Any, average: Optional[bool], name: Optional[str], op: Any, prescale_factor: float,
                postscale_factor: float, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.scales, ctx.process_set = _op(op, average, "grouped_allreduce"), (prescale_factor,
                                                                                        postscale_factor), process_set
        outs = synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                                   postscale_factor, process_set))
        if ctx.op in (Min, Max, Product):
            ctx.save_for_backward(*tensors, *outs)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        k = len(grads)
        saved = ctx.saved_tensors or (None,) * (2 * k)
        gs = _reduce_backward(list(grads), saved[:k], saved[k:], ctx.op, *ctx.scales, ctx.process_set)
        return (None,) * 6 + tuple(gs)


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather: backward sums the gradients across ranks and keeps this rank's rows."""

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
    """Sum the gradients of the gathered tensors over ranks, then cut out this rank's rows."""
    rows = [shape[0] if len(shape) else 1 for shape in shapes]
    summed = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=Sum,
                                                 process_set=process_set))
    all_rows = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), process_set=process_set))
    offsets = all_rows[:process_set.rank()].sum(dim=0).tolist()
    return [s.narrow(0, int(o), n).reshape(shape) for s, o, n, shape in zip(summed, offsets, rows, shapes)]


class HorovodBroadcast(torch.autograd.Function):
    """Differentiable broadcast: the root receives the sum of every rank's gradient, others zero."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        summed = synchronize(grouped_allreduce_async([grad.contiguous()], op=Sum,
                                                     process_set=ctx.process_set))[0]
        if ctx.process_set.rank() != ctx.root_rank:
            summed = torch.zeros_like(summed)
        return summed, None, None, None


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
    """Differentiable reducescatter: backward allgathers the gradients (scaled like the forward)."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: Any, process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float, *tensors: torch.Tensor) -> tuple:
        ctx.op = _op(op, None, "reducescatter")
        ctx.scale, ctx.process_set = prescale_factor * postscale_factor, process_set
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                             postscale_factor)))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        if ctx.op not in (Sum, Average):
            raise RuntimeError(f"hvdlite: reducescatter with {ctx.op!r} has no gradient; use hvd.Sum or "
                               f"hvd.Average")
        scale = ctx.scale / (ctx.process_set.size() if ctx.op is Average else 1)
        gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads],
                                                       process_set=ctx.process_set))
        return (None,) * 5 + tuple(g * scale if scale != 1.0 else g for g in gathered)


# -- the public synchronous functions -----------------------------------------------------------------
def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` across ranks (Average by default); differentiable; the input is unmodified."""
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one unit; differentiable; returns new tensors."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                         *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dimension 0 (sizes may differ); differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A copy of root_rank's ``tensor`` on every rank; differentiable; the input is unmodified."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatter rows to every rank and gather theirs; returns (tensor, received_splits) when splits is
    given, else the tensor alone (Horovod's convention); differentiable."""
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` and keep this rank's share of dimension 0 (earlier ranks take the remainder)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                      *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]
