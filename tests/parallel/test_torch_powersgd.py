"""hvdlite.torch.powersgd in every rank, driven through the comm-hook bucket protocol (a flat buffer with per-
parameter views, as the optimizer's buckets): plain averaging before start_powerSGD_iter, exact reconstruction of
a low-rank average, the error-feedback identity, warm start as power iteration, the bytes sent, and training the
digits CNN at rank 1 and 4 to within 1% of uncompressed accuracy with bitwise-identical weights on every rank."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hvdlite.torch as hvd
from hvdlite.torch.powersgd import PowerSGDState, powerSGD_hook

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 420
R, N = hvd.rank(), hvd.size()


class Bucket:
    """A gradient bucket as the optimizer hands it to a hook: one flat buffer, the gradients are views of it."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool, dtype: Optional[torch.dtype] = None):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype or params[0].dtype)
        self._views, at = [], 0
        for p in params:
            self._views.append(self._buffer[at:at + p.numel()].view(p.shape))
            at += p.numel()
        self.process_set = hvd.global_process_set
        self.name = f"test.bucket{index}"

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def load(self, grads: list[torch.Tensor]) -> None:
        for view, g in zip(self._views, grads):
            view.copy_(g)


def run_hook(state: PowerSGDState, bucket: Bucket, grads: list[torch.Tensor]) -> torch.Tensor:
    bucket.load(grads)
    out = powerSGD_hook(state, bucket).wait()
    assert out.shape == bucket.buffer().shape and out.dtype == bucket.buffer().dtype
    return out.clone()


def every_rank(fn: Any) -> torch.Tensor:
    return torch.stack([fn(r) for r in range(N)])


def low_rank(r: int) -> torch.Tensor:  # rank r's 16x8 gradient: a multiple of one rank-1 matrix
    g = torch.Generator().manual_seed(7)
    return (r + 1.0) * torch.outer(torch.randn(16, generator=g, dtype=torch.float64),
                                   torch.randn(8, generator=g, dtype=torch.float64))


def small(r: int) -> torch.Tensor:  # 3x3: (3+3)*1*2 >= 9, never compressed
    return torch.arange(9, dtype=torch.float64).reshape(3, 3) * (r + 2)


def bias(r: int) -> torch.Tensor:
    return torch.arange(3, dtype=torch.float64) + 10 * r


def test_plain_average_before_start_then_exact_for_a_low_rank_average() -> None:
    params = [torch.zeros(16, 8, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64),
              torch.zeros(3, dtype=torch.float64)]
    bucket = Bucket(0, params, last=True)
    state = PowerSGDState(start_powerSGD_iter=2, matrix_approximation_rank=1)
    full_rank = [torch.randn(16, 8, generator=torch.Generator().manual_seed(R), dtype=torch.float64),
                 small(R), bias(R)]
    exact = torch.cat([every_rank(lambda r: torch.randn(16, 8, generator=torch.Generator().manual_seed(r),
                                                        dtype=torch.float64)).mean(0).reshape(-1),
                       every_rank(small).mean(0).reshape(-1), every_rank(bias).mean(0)])
    for step in range(2):  # iterations 0 and 1: plain averaging, whatever the rank of the matrices
        diff = (run_hook(state, bucket, full_rank) - exact).abs().max()
        assert diff < 1e-14, f"iteration {step} is not the average: {diff}"
    assert state.iter == 2 and state.bytes_allreduced == 2 * exact.numel() * 8
    out = run_hook(state, bucket, [low_rank(R), small(R), bias(R)])  # compressed from now on
    expected = torch.cat([every_rank(low_rank).mean(0).reshape(-1), every_rank(small).mean(0).reshape(-1),
                          every_rank(bias).mean(0)])
    assert (out - expected).abs().max() < 1e-12, (out - expected).abs().max()
    # sent: P (16) and Q (8) for the 16x8 matrix, the 3x3 and the bias (12) uncompressed, 8 bytes each
    assert state.bytes_allreduced == 2 * exact.numel() * 8 + (16 + 8 + 12) * 8
    assert state.compression_stats() == (exact.numel() / (16 + 8 + 12), exact.numel(), 16 + 8 + 12)


def test_error_feedback_accumulates_exactly_what_was_lost() -> None:
    """With error feedback, rank r's error after T steps is T*g_r minus the sum of the outputs, so
    sum(outputs) + mean over ranks of the errors = T * mean(g): nothing is lost, only delayed."""
    def grad(r: int) -> torch.Tensor:
        return torch.randn(32, 24, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
    for feedback in (True, False):
        bucket = Bucket(0, [torch.zeros(32, 24, dtype=torch.float64)], last=True)
        state = PowerSGDState(start_powerSGD_iter=0, matrix_approximation_rank=2, use_error_feedback=feedback)
        total = sum(run_hook(state, bucket, [grad(R)]) for _ in range(6))
        error = state.error_dict[0] if feedback else torch.zeros_like(total)
        errors = hvd.allgather(error.unsqueeze(0))
        target = 6 * every_rank(grad).mean(0).reshape(-1)
        diff = (total + errors.mean(0) - target).abs().max().item()
        assert (diff < 1e-9) is feedback, (feedback, diff)
        assert feedback or 0 not in state.error_dict


def test_warm_start_is_power_iteration() -> None:
    """The same gradient every step: with warm start Q carries over and the approximation converges to the best
    rank-1 one (top singular pair); without it each step starts from fresh random Q."""
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(20, 4, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(12, 4, generator=g, dtype=torch.float64))
    matrix = u @ torch.diag(torch.tensor([10.0, 3.0, 1.0, 0.5], dtype=torch.float64)) @ v.T
    best = 10.0 * torch.outer(u[:, 0], v[:, 0])
    for warm in (True, False):
        bucket = Bucket(0, [torch.zeros(20, 12, dtype=torch.float64)], last=True)
        state = PowerSGDState(start_powerSGD_iter=0, use_error_feedback=False, warm_start=warm, random_seed=5)
        for _ in range(12):
            out = run_hook(state, bucket, [matrix * (R + 1) * 2 / (N + 1)])  # average over ranks: matrix
        rel = ((out.view(20, 12) - best).norm() / best.norm()).item()
        assert (rel < 1e-6) is warm, (warm, rel)
        assert (0 in state.q_memory_dict) is warm


def test_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="matrix_approximation_rank must be >= 1"):
        PowerSGDState(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="start_powerSGD_iter must be >= 0"):
        PowerSGDState(start_powerSGD_iter=-1)


# -- training the digits CNN through buckets -------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


_digits = load_digits()
IMAGES = torch.tensor(_digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
LABELS = torch.tensor(_digits.target, dtype=torch.int64)
TEST = 360
EPOCHS, GLOBAL_BATCH = 10, 48  # the same global batch, so the same number of steps, at every size
BATCH = GLOBAL_BATCH // N
STEPS = EPOCHS * ((len(LABELS) - TEST) // N // BATCH)


def allreduce_hook(state: Any, bucket: Bucket) -> Any:  # the uncompressed reference
    return hvd.allreduce_async_(bucket.buffer(), name=f"{bucket.name}.plain", op=hvd.Average)


def train(state: Optional[PowerSGDState]) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    buckets = [Bucket(0, params[4:], last=False), Bucket(1, params[:4], last=True)]  # backward order, as DDP
    train_x, train_y = IMAGES[TEST:], LABELS[TEST:]
    hook = powerSGD_hook if state is not None else allreduce_hook
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)  # converge: the noise fades out
    for epoch in range(EPOCHS):
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch))
        mine = order[R::N]
        for start in range(0, len(mine) - BATCH + 1, BATCH):
            rows = mine[start:start + BATCH]
            opt.zero_grad()
            F.cross_entropy(model(train_x[rows]), train_y[rows]).backward()
            futures = []
            for bucket in buckets:
                bucket.load([p.grad for p in bucket.parameters()])
                futures.append(hook(state, bucket))
            for bucket, future in zip(buckets, futures):
                out = future.wait()
                if out is not bucket.buffer():
                    bucket.buffer().copy_(out)
                for p, view in zip(bucket.parameters(), bucket.gradients()):
                    p.grad.copy_(view)
            opt.step()
            schedule.step()
    with torch.no_grad():
        accuracy = (model(IMAGES[:TEST]).argmax(1) == LABELS[:TEST]).double().mean().item()
    return accuracy, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_digits_trains_to_within_one_percent_of_uncompressed_at_rank_1_and_4() -> None:
    plain, _ = train(None)
    assert plain > 0.9, plain
    for rank in (1, 4):
        # the first quarter of the steps uncompressed (torch's advice: start once the loss has come down)
        state = PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=STEPS // 4)
        accuracy, weights = train(state)
        every = hvd.allgather(weights.unsqueeze(0))
        assert torch.equal(every, weights.expand_as(every)), f"rank {rank}: weights differ between ranks"
        assert accuracy >= plain - 0.01, f"PowerSGD rank {rank}: accuracy {accuracy:.4f}, uncompressed {plain:.4f}"
        rate, before, after = state.compression_stats()
        assert rate > 2 and state.iter == STEPS, (rate, before, after, state.iter)


def test_powerSGD_hook_through_register_comm_hook() -> None:
    """The real optimizer's buckets: DistributedOptimizer.register_comm_hook(state, powerSGD_hook) trains the CNN
    with the same weights on every rank, compressing after start_powerSGD_iter."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=3)
    opt.register_comm_hook(state, powerSGD_hook)
    rows = torch.arange(TEST, len(LABELS))[R::N]
    losses = []
    for step in range(12):
        batch = rows[(step * BATCH) % (len(rows) - BATCH):][:BATCH]
        opt.zero_grad()
        loss = F.cross_entropy(model(IMAGES[batch]), LABELS[batch])
        loss.backward()
        opt.step()
        losses.append(float(hvd.allreduce(loss.detach())))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(weights.unsqueeze(0))
    assert torch.equal(every, weights.expand_as(every)), "weights differ between ranks"
    assert state.iter == 12 and losses[-1] < losses[0], (state.iter, losses)
    full = sum(p.numel() for p in model.parameters()) * 4
    assert state.compression_stats()[0] > 2 and state.bytes_allreduced < 3 * full + 9 * full / 2, \
        (state.compression_stats(), state.bytes_allreduced, full)
