"""PowerSGD (Vogels et al., NeurIPS 2019) as a gradient-bucket comm hook: PowerSGDState and powerSGD_hook, with torch's
keyword names and semantics, over hvdlite's asynchronous allreduces."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import numpy as np
import torch

from hvdlite.core import ProcessSet

from .async_ops import Average, Sum, allreduce_async_

__all__ = ["PowerSGDState", "powerSGD_hook"]

_log = logging.getLogger(__name__)


class PowerSGDState:
    """What powerSGD_hook keeps between steps. The keywords are torch's (docs/torch.md), with hvdlite's
    ``process_set`` in place of ``process_group`` (None: the bucket's own process set)."""

    def __init__(self, process_set: Optional[ProcessSet] = None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True, orthogonalization_epsilon: float = 0,
                 random_seed: int = 0) -> None:
        if int(matrix_approximation_rank) < 1:
            raise ValueError(f"PowerSGDState: matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        if int(start_powerSGD_iter) < 0:
            raise ValueError(f"PowerSGDState: start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}")
        if not min_compression_rate > 0:
            raise ValueError(f"PowerSGDState: min_compression_rate must be > 0, got {min_compression_rate}")
        self.process_set = process_set
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.rng = np.random.RandomState(random_seed)  # the same draws on every rank: the same initial Q
        self.iter = 0
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        #: bytes of the tensors this state's hook has handed to allreduce (all iterations, both phases)
        self.bytes_allreduced = 0

    def maybe_increase_iter(self, bucket: Any) -> None:
        """Count one iteration per backward pass (on its last bucket)."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                _log.info("PowerSGD: compression starts after %d iterations", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after) over the compressed iterations so far."""
        rate = self.total_numel_before_compression / max(self.total_numel_after_compression, 1)
        return rate, self.total_numel_before_compression, self.total_numel_after_compression

    def __getstate__(self) -> dict:
        """Picklable for checkpoints; the process set is not (it belongs to the running job)."""
        state = dict(self.__dict__)
        state["process_set"] = None
        return state

    def _reduce_set(self, bucket: Any) -> ProcessSet:
        given = bucket.process_set
        if self.process_set is not None and self.process_set is not given:
            raise ValueError(f"powerSGD_hook: bucket {bucket.name!r} is reduced over {given!r} but its "
                             f"PowerSGDState was made for {self.process_set!r}; give the state process_set=None "
                             f"(the bucket's) or the optimizer's process set")
        return given

    def _allreduce(self, tensor: torch.Tensor, name: str, op: Any, process_set: ProcessSet) -> Any:
        self.bytes_allreduced += tensor.numel() * tensor.element_size()
        return allreduce_async_(tensor, name=name, op=op, process_set=process_set)


class _Future:
    """The hook's result: ``wait()`` (run once) finishes the rounds and returns the bucket's averaged buffer."""

    def __init__(self, finish: Callable[[], torch.Tensor]) -> None:
        self.wait = self.value = functools.cache(finish)


def _orthogonalize(matrix: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``matrix``, in place (deterministic: the same on every rank)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(col)
        if epsilon:
            col.div_(norm + epsilon)
        elif norm > 0:
            col.div_(norm)
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest.sub_((col * rest).sum(0, keepdim=True) * col)


def _views(memory: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [m.view(shape) for m, shape in zip(memory.split([r * c for r, c in shapes]), shapes)]


def powerSGD_hook(state: PowerSGDState, bucket: Any) -> Any:
    """Average ``bucket``'s gradients over its process set with rank-r PowerSGD compression: the uncompressed
    tensors' and P's allreduces start here, Q's in ``wait()`` (docs/torch.md)."""
    process_set = state._reduce_set(bucket)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return state._allreduce(buffer, f"{bucket.name}.powersgd.full", Average, process_set)

    index = bucket.index()
    before: Optional[torch.Tensor] = None
    if state.use_error_feedback:
        error = state.error_dict.get(index)
        if error is not None and error.shape == buffer.shape:
            buffer.add_(error)
        before = buffer.clone()
    rank = state.matrix_approximation_rank
    matrices: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    for grad in bucket.gradients():
        n = grad.shape[0] if grad.dim() >= 2 else grad.numel()
        m = grad.numel() // max(n, 1)
        r = min(n, m, rank)
        small = (n + m) * r
        if grad.dim() >= 2 and grad.numel() and small * state.min_compression_rate < n * m:
            matrices.append(grad.view(n, m))
            state.total_numel_after_compression += small
        else:
            plain.append(grad)
            state.total_numel_after_compression += grad.numel()
        state.total_numel_before_compression += grad.numel()

    uncompressed = torch.cat([t.reshape(-1) for t in plain]) if plain else None
    plain_handle = None if uncompressed is None else state._allreduce(
        uncompressed, f"{bucket.name}.powersgd.uncompressed", Average, process_set)
    p_shapes = [(mat.shape[0], min(mat.shape[0], mat.shape[1], rank)) for mat in matrices]
    q_shapes = [(mat.shape[1], min(mat.shape[0], mat.shape[1], rank)) for mat in matrices]
    p_size, q_size = sum(a * b for a, b in p_shapes), sum(a * b for a, b in q_shapes)
    p_memory, q_memory = state.p_memory_dict.get(index), state.q_memory_dict.get(index)
    fresh = (not state.warm_start or p_memory is None or q_memory is None or p_memory.numel() != p_size
             or q_memory.numel() != q_size)
    if fresh:
        p_memory, q_memory = buffer.new_empty(p_size), buffer.new_empty(q_size)
        state.p_memory_dict[index], state.q_memory_dict[index] = p_memory, q_memory
    assert p_memory is not None and q_memory is not None
    ps, qs = _views(p_memory, p_shapes), _views(q_memory, q_shapes)
    if fresh and matrices:
        generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=generator, dtype=q.dtype))
            _orthogonalize(q, state.orthogonalization_epsilon)
    for mat, p, q in zip(matrices, ps, qs):
        torch.matmul(mat, q, out=p)
    p_handle = state._allreduce(p_memory, f"{bucket.name}.powersgd.p", Sum, process_set) if matrices else None

    def finish() -> torch.Tensor:
        if plain_handle is not None and uncompressed is not None:
            plain_handle.wait()
            for t, piece in zip(plain, uncompressed.split([t.numel() for t in plain])):
                t.copy_(piece.view_as(t))
        if p_handle is not None:
            p_handle.wait()
            for mat, p, q in zip(matrices, ps, qs):
                _orthogonalize(p, state.orthogonalization_epsilon)
                torch.matmul(mat.t(), p, out=q)
            state._allreduce(q_memory, f"{bucket.name}.powersgd.q", Average, process_set).wait()
            for mat, p, q in zip(matrices, ps, qs):
                torch.matmul(p, q.t(), out=mat)
        if before is not None:
            state.error_dict[index] = before - buffer
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return buffer

    return _Future(finish)
