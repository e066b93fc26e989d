"""hvdlite.lightning.HvdliteStrategy under real Lightning in every rank: trainer.fit on digits equals single-process
training on the global batch (with and without accumulation, gradient overlap on and off), the same weights on
every rank, a checkpoint written by rank 0 only and resumed exactly, logged metrics averaged over the ranks,
all_gather (values and DDP's gradient convention), trainer.test and trainer.predict.

The single-process reference is computed in every rank with plain torch: DistributedSampler(shuffle=True)
gives step k of epoch e the global batch perm_e[k*G:(k+1)*G] (perm_e = randperm seeded seed+e), whichever
rank holds which rows."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvdlite.lightning  # noqa: F401  (registers strategy="hvdlite")
import hvdlite.torch as hvd
from hvdlite.lightning import HvdliteStrategy

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 420
R, N = hvd.rank(), hvd.size()
G, TRAIN, VAL = 24, 240, 120  # global batch; set sizes divisible by G and by 2 and 3 (no sampler padding)
LR = 0.2
_digits = load_digits()
X = torch.tensor(_digits.data, dtype=torch.float64) / 16.0
Y = torch.tensor(_digits.target, dtype=torch.int64)
TRAIN_SET = TensorDataset(X[:TRAIN], Y[:TRAIN])
VAL_SET = TensorDataset(X[TRAIN:TRAIN + VAL], Y[TRAIN:TRAIN + VAL])
TEST_IDX = torch.arange(TRAIN + VAL, TRAIN + VAL + 360)


class Digits(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        mine = torch.tensor(R + 1.0, dtype=torch.float64)
        self.log("rank_mean", mine, sync_dist=True, on_step=False, on_epoch=True)
        self.log("rank_max", mine, sync_dist=True, reduce_fx="max", on_step=False, on_epoch=True)
        self.log("rank_local", mine, on_step=False, on_epoch=True)
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_acc", (self(x).argmax(1) == y).double().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, index = batch
        return torch.stack([index, self(x).argmax(1)], 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)


def trainer(strategy: Any = "hvdlite", **kwargs: Any) -> L.Trainer:
    settings: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                                    enable_model_summary=False, enable_checkpointing=False)
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, **settings)


def train_loader() -> DataLoader:
    return DataLoader(TRAIN_SET, batch_size=G // N, shuffle=True)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(epochs: int, accumulate: int = 1) -> torch.Tensor:
    """Single process, rank 0's initial weights, the global batches in the sampler's order. Lightning scales
    each micro-batch's loss by 1/accumulate and steps at the end of the epoch with what has accumulated."""
    model = Digits(seed=100)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    for epoch in range(epochs):
        perm = torch.randperm(TRAIN, generator=torch.Generator().manual_seed(seed + epoch))
        batches = [perm[k * G:(k + 1) * G] for k in range(TRAIN // G)]
        for w in range(0, len(batches), accumulate):
            window = batches[w:w + accumulate]
            rows = torch.cat(window)
            opt.zero_grad()
            (F.cross_entropy(model(X[rows]), Y[rows]) * len(window) / accumulate).backward()
            opt.step()
    return flat(model)


def assert_same_everywhere(w: torch.Tensor, what: str) -> None:
    every = hvd.allgather(w.unsqueeze(0))
    assert torch.equal(every, w.expand_as(every)), f"{what}: weights differ between ranks"


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-10) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"{what}: max difference {diff} > {tol}"


@pytest.mark.parametrize("overlap,accumulate,by_name", [("on", 1, True), ("on", 3, False), ("off", 1, False)])
def test_fit_equals_single_process_on_the_global_batch(overlap: str, accumulate: int, by_name: bool,
                                                       reinit: Callable[..., None]) -> None:
    reinit(gradient_overlap=overlap)
    model = Digits(seed=100 + R)  # different initial weights per rank: rank 0's must be broadcast
    fit = trainer("hvdlite" if by_name else HvdliteStrategy(), max_epochs=2, accumulate_grad_batches=accumulate,
                  limit_val_batches=0)
    assert isinstance(fit.strategy, HvdliteStrategy) and fit.world_size == N and fit.global_rank == R
    fit.fit(model, train_loader())
    sampler = fit.train_dataloader.sampler
    assert isinstance(sampler, DistributedSampler) and (sampler.num_replicas, sampler.rank) == (N, R), sampler
    opt = fit.optimizers[0]
    assert isinstance(opt, torch.optim.SGD) and hasattr(opt, "synchronize"), type(opt)  # hvdlite-wrapped
    assert opt.backward_passes_per_step == accumulate and opt.overlap is (overlap == "on"), opt.overlap
    assert fit.global_step == 2 * -(-(TRAIN // G) // accumulate)
    close(flat(model), reference(2, accumulate), f"weights vs single process (accumulate={accumulate})")
    assert_same_everywhere(flat(model), "after fit")


def test_checkpoint_written_by_rank_zero_only_and_resumed(tmp_path: Path) -> None:
    shared = Path(hvd.broadcast_object(str(tmp_path), root_rank=0))
    first = trainer(max_epochs=1, limit_val_batches=0)
    first.fit(Digits(seed=100 + R), train_loader())
    first.save_checkpoint(shared / f"rank{R}.ckpt")  # every rank asks, with its own path
    assert sorted(os.listdir(shared)) == ["rank0.ckpt"], os.listdir(shared)
    hvd.barrier()  # every rank has looked before anything else is written there
    model = Digits(seed=200 + R)  # other weights: all must come from the checkpoint
    second = trainer(max_epochs=2, limit_val_batches=0)
    second.fit(model, train_loader(), ckpt_path=shared / "rank0.ckpt")
    assert second.global_step == 2 * (TRAIN // G)
    close(flat(model), reference(2), "resumed from epoch 1 vs two epochs uninterrupted")
    assert_same_everywhere(flat(model), "after resume")


def test_logged_metrics_synced_all_gather_test_and_predict() -> None:
    model = Digits(seed=100 + R)
    run = trainer(max_epochs=1)
    run.fit(model, train_loader(), DataLoader(VAL_SET, batch_size=20))
    metrics = run.callback_metrics
    assert float(metrics["rank_mean"]) == (N + 1) / 2, metrics  # mean over ranks of rank+1
    assert float(metrics["rank_max"]) == N, metrics
    assert float(metrics["rank_local"]) == R + 1, metrics  # no sync_dist: this rank's own
    with torch.no_grad():
        expected_val = F.cross_entropy(model(VAL_SET.tensors[0]), VAL_SET.tensors[1]).item()
    close(torch.tensor(float(metrics["val_loss"])), torch.tensor(expected_val), "synced val_loss", tol=1e-6)

    gathered = model.all_gather(torch.tensor([R, 10 * R]))
    assert torch.equal(gathered, torch.tensor([[r, 10 * r] for r in range(N)])), gathered
    assert torch.equal(model.all_gather(torch.tensor(float(R))), torch.arange(N, dtype=torch.float32))
    x = torch.full((2,), float(R + 1), dtype=torch.float64, requires_grad=True)
    weights = torch.arange(1.0, 2 * N + 1, dtype=torch.float64).reshape(N, 2) * (R + 1)  # rank-dependent loss
    (model.all_gather(x, sync_grads=True) * weights).sum().backward()
    factor = sum(q + 1 for q in range(N))  # DDP's convention: the sum over ranks of each rank's gradient
    assert torch.equal(x.grad, torch.arange(1.0, 2 * N + 1, dtype=torch.float64).reshape(N, 2)[R] * factor), x.grad
    with pytest.raises(ValueError, match="torch.distributed process groups"):
        run.strategy.reduce(torch.ones(1), group=object())

    test_set = TensorDataset(X[TEST_IDX], Y[TEST_IDX], TEST_IDX)
    with torch.no_grad():
        predicted = model(X[TEST_IDX]).argmax(1)
    tested = run.test(model, DataLoader(test_set, batch_size=30), verbose=False)
    close(torch.tensor(tested[0]["test_acc"]), (predicted == Y[TEST_IDX]).double().mean(), "synced test_acc",
          tol=1e-6)
    mine = torch.cat(run.predict(model, DataLoader(test_set, batch_size=30)))
    everything = hvd.allgather(mine)
    order = everything[:, 0].argsort()
    assert torch.equal(everything[order, 0], TEST_IDX), "each test row predicted exactly once over the ranks"
    assert torch.equal(everything[order, 1], predicted)


def test_string_name_is_registered_and_a_rank_refuses_a_torch_group() -> None:
    from lightning.pytorch.strategies import StrategyRegistry
    assert "hvdlite" in StrategyRegistry and StrategyRegistry["hvdlite"]["strategy"] is HvdliteStrategy
    strategy: Optional[HvdliteStrategy] = HvdliteStrategy()
    assert strategy is not None and strategy.reduce(3) == 3  # not a tensor: returned as is
    assert int(strategy.reduce(torch.tensor(R), reduce_op="sum")) == N * (N - 1) // 2
    assert strategy.broadcast(f"from {R}", src=N - 1) == f"from {N - 1}"
    with pytest.raises(ValueError, match="unsupported reduce_op"):
        strategy.reduce(torch.ones(1), reduce_op="bitwise_or")
    strategy.barrier("test")
