"""hvd.Adasum in hvdlite.torch: the collectives against a numpy reference for every float dtype,
DistributedOptimizer(op=hvd.Adasum) against a single-process simulation of Horovod's delta scheme, an Adasum
training run on the digits task, and the clear error on a set that is not a power of two."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import hvdlite.torch as hvd
from adasum_reference import reference

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 400
POW2 = pytest.mark.mpi(sizes=(2, 4))

DTYPES = {"float16": (torch.float16, 2e-3), "bfloat16": (torch.bfloat16, 2e-2), "float32": (torch.float32, 1e-5),
          "float64": (torch.float64, 1e-12)}


def rank_tensors(size: int, n: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input (each rank can compute all of them), already rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.standard_normal(n)).to(dtype) for _ in range(size)]


def expected(tensors: list[torch.Tensor]) -> np.ndarray:
    return reference([t.double().numpy() for t in tensors])


def close(got: torch.Tensor, want: np.ndarray, tol: float) -> None:
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)


REDUCE: dict[str, Callable[[list[torch.Tensor], str], list[torch.Tensor]]] = {
    "allreduce": lambda ts, n: [hvd.allreduce(t, op=hvd.Adasum, name=f"{n}.{i}") for i, t in enumerate(ts)],
    "allreduce_async": lambda ts, n: [hvd.synchronize(hvd.allreduce_async(t, op=hvd.Adasum, name=f"{n}.{i}"))
                                      for i, t in enumerate(ts)],
    "allreduce_": lambda ts, n: [hvd.allreduce_(t.clone(), op=hvd.Adasum, name=f"{n}.{i}") for i, t in enumerate(ts)],
    "allreduce_async_": lambda ts, n: [hvd.synchronize(hvd.allreduce_async_(t.clone(), op=hvd.Adasum,
                                                                            name=f"{n}.{i}"))
                                       for i, t in enumerate(ts)],
    "grouped_allreduce": lambda ts, n: hvd.grouped_allreduce(ts, op=hvd.Adasum, name=n),
    "grouped_allreduce_async": lambda ts, n: hvd.synchronize(hvd.grouped_allreduce_async(ts, op=hvd.Adasum, name=n)),
    "grouped_allreduce_": lambda ts, n: hvd.grouped_allreduce_([t.clone() for t in ts], op=hvd.Adasum, name=n),
    "grouped_allreduce_async_": lambda ts, n: hvd.synchronize(hvd.grouped_allreduce_async_(
        [t.clone() for t in ts], op=hvd.Adasum, name=n)),
}


@POW2
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", REDUCE)
def test_collectives_equal_the_reference(rank: int, size: int, fn: str, dtype: str) -> None:
    torch_dtype, tol = DTYPES[dtype]
    per_tensor = [rank_tensors(size, n, seed=n, dtype=torch_dtype) for n in (1, 33, 1000)]
    outs = REDUCE[fn]([ts[rank] for ts in per_tensor], f"{fn}.{dtype}")
    for out, ts in zip(outs, per_tensor):
        assert out.dtype == torch_dtype and out.shape == ts[rank].shape
        close(out, expected(ts), tol)


@POW2
def test_differentiable_allreduce_backward_is_adasum_of_the_gradients(rank: int, size: int) -> None:
    x = rank_tensors(size, 5, seed=1, dtype=torch.float64)[rank].requires_grad_()
    ups = rank_tensors(size, 5, seed=2, dtype=torch.float64)
    (hvd.allreduce(x, op=hvd.Adasum, name="grad") * ups[rank]).sum().backward()
    close(x.grad, expected(ups), 1e-12)


# -- DistributedOptimizer(op=hvd.Adasum): Horovod's delta scheme ---------------------------------------
STEPS, BATCH = 4, 5
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def batch(step: int, rank: int, backward_pass: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + backward_pass)
    return (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=g, dtype=torch.float64))


def loss_of(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(data[0]), data[1])


def simulate(size: int, opt_name: str, passes: int) -> list[torch.Tensor]:
    """One process plays every rank: each steps its own optimizer from the shared start on its own batches;
    the deltas are combined by the reference tree, parameter by parameter, and added to the start."""
    cls, kwargs = OPTIMIZERS[opt_name]
    models = [make_model() for _ in range(size)]
    opts = [cls(m.parameters(), **kwargs) for m in models]
    for step in range(STEPS):
        start = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            with torch.no_grad():
                for p, s in zip(model.parameters(), start):
                    p.copy_(s)
            opt.zero_grad()
            for b in range(passes):
                loss_of(model, batch(step, r, b)).backward()
            opt.step()
            deltas.append([p.detach() - s for p, s in zip(model.parameters(), start)])
        combined = [torch.from_numpy(reference([d[i].numpy().ravel() for d in deltas])).view_as(s) + s
                    for i, s in enumerate(start)]
        for model in models:
            with torch.no_grad():
                for p, c in zip(model.parameters(), combined):
                    p.copy_(c)
    return [p.detach() for p in models[0].parameters()]


def assert_identical_everywhere(model: torch.nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    for row in gathered:
        assert torch.equal(row, flat)


@POW2
@pytest.mark.parametrize("overlap", ["on", "off"])
@pytest.mark.parametrize("groups", [None, 2], ids=["per-parameter", "groups=2"])
@pytest.mark.parametrize("passes", [1, 2], ids=["bpps1", "bpps2"])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_delta_optimizer_equals_the_simulated_scheme(reinit, rank: int, size: int, opt_name: str, passes: int,
                                                     groups: Any, overlap: str) -> None:
    reinit(gradient_overlap=overlap)
    cls, kwargs = OPTIMIZERS[opt_name]
    model = make_model()
    opt = hvd.DistributedOptimizer(cls(model.parameters(), **kwargs), named_parameters=model.named_parameters(),
                                   op=hvd.Adasum, backward_passes_per_step=passes, groups=groups)
    assert isinstance(opt, cls)
    for step in range(STEPS):
        opt.zero_grad()
        for b in range(passes):
            loss_of(model, batch(step, rank, b)).backward()
        opt.step()
    for got, want in zip(model.parameters(), simulate(size, opt_name, passes)):
        np.testing.assert_allclose(got.detach().numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    assert_identical_everywhere(model)


@POW2
def test_delta_optimizer_with_fp16_compression(rank: int, size: int) -> None:
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), op=hvd.Adasum,
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, batch(step, rank, 0)).backward()
        opt.step()
    for got, want in zip(model.parameters(), simulate(size, "sgd_momentum", 1)):
        np.testing.assert_allclose(got.detach().numpy(), want.numpy(), rtol=0, atol=2e-3)
    assert_identical_everywhere(model)


@POW2
def test_delta_optimizer_leaves_a_parameter_without_gradient_alone(rank: int, size: int) -> None:
    """As in Horovod, a parameter that has no gradient is not stepped locally (its delta is zero), even with
    momentum and weight decay (a zero gradient would let them move it)."""
    model = make_model()
    unused = torch.nn.Linear(3, 3).double()
    before = [p.detach().clone() for p in unused.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + list(unused.parameters()), lr=0.1,
                                                   momentum=0.9, weight_decay=0.1), op=hvd.Adasum)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, batch(step, rank, 0)).backward()
        opt.step()
    for p, b in zip(unused.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert_identical_everywhere(model)


@POW2
def test_delta_optimizer_refuses_skip_synchronize(rank: int) -> None:
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    with pytest.raises(AssertionError, match="Skipping synchronization is not supported when using Adasum"):
        with opt.skip_synchronize():
            pass


@POW2
def test_adasum_training_on_digits_converges(rank: int, size: int) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=0)
    x_train, y_train = torch.tensor(x_train[rank::size], dtype=torch.float32), torch.tensor(y_train[rank::size])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # Adasum: the single-process learning rate, not scaled by the number of ranks
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), op=hvd.Adasum,
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(8):
        order = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(order) - 31, 32):  # the same number of steps on every rank
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
    assert_identical_everywhere(model)
    with torch.no_grad():
        accuracy = (model(torch.tensor(x_test, dtype=torch.float32)).argmax(1) == torch.tensor(y_test)).double().mean()
    assert accuracy >= 0.9, f"test accuracy {accuracy:.3f} after Adasum training on {size} ranks"


@pytest.mark.mpi(sizes=(3,))
def test_three_ranks_get_a_clear_error(rank: int) -> None:
    message = r"hvd.Adasum needs a power-of-two number of ranks in the process set \(got 3\)"
    with pytest.raises(ValueError, match=message):
        hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="three")
    with pytest.raises(ValueError, match=message):
        hvd.grouped_allreduce_async_([torch.ones(3)], op=hvd.Adasum, name="three.grouped")
    model = make_model()
    with pytest.raises(ValueError, match=message):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
