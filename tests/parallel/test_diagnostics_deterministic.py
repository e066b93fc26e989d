"""deterministic=True: every reduction is the rank-order sum of the ranks' values, element by element, so a
training run gives bit-identical weights under very different fusion, chunk and cycle settings, with the
autotune switching them mid-run, and whatever order the ranks submit in; on the MPI path and on the
torch.distributed (gloo) data plane (``cpu_operations="gloo"``, set per test: no second spawn); Adasum's bits do
not depend on fusion either."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdlite as hvd_core
import hvdlite.torch as hvd

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 300
#: torch CPU tensors' data path: hvdlite's MPI engine, or the torch.distributed gloo plane (HOROVOD_CPU_OPERATIONS)
PLANES = ("mpi", "gloo")

#: two very different settings: everything fused in big chunks, versus nothing fused and 256-byte chunks
BIG = dict(fusion_threshold_bytes=64 << 20, allreduce_chunk_bytes=64 << 20, cycle_time_ms=0.5)
SMALL = dict(fusion_threshold_bytes=0, allreduce_chunk_bytes=256, cycle_time_ms=5.0)


def _rank_order(values: np.ndarray) -> np.ndarray:
    acc = values[0].copy()
    for v in values[1:]:
        acc = acc + v
    return acc


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_each_element_is_the_rank_order_sum_in_any_submission_order(reinit, dtype: type, rank: int,
                                                                    size: int) -> None:
    reinit(deterministic=True, **SMALL)
    rng = np.random.default_rng(rank)
    xs = [(rng.normal(size=n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(dtype) for n in (1, 5, 300, 4099)]
    order = list(range(len(xs)))[::(-1 if rank % 2 else 1)]  # odd ranks submit in reverse order
    handles = {i: hvd_core.allreduce_async(xs[i], op=hvd_core.Sum, name=f"det.{i}") for i in order}
    for i, x in enumerate(xs):
        got = hvd_core.synchronize(handles[i])
        expected = _rank_order(hvd_core.allgather(x[None], name=f"det.all.{i}"))
        assert got.dtype == expected.dtype and np.array_equal(got, expected), i
    x = xs[3][:size * 7].copy()
    got = hvd_core.reducescatter(x, op=hvd_core.Sum, name="det.rs")
    everyone = hvd_core.allgather(x[None], name="det.rs.all")
    assert np.array_equal(got, _rank_order(everyone)[rank * 7:(rank + 1) * 7])


@pytest.mark.parametrize("plane", PLANES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_torch_tensors_fused_are_the_rank_order_sum(reinit, plane: str, dtype: torch.dtype, rank: int,
                                                    size: int) -> None:
    """torch tensors on either data path, fused into one batch: each element is the rank-order sum, and each
    reducescatter slice."""
    reinit(deterministic=True, cpu_operations=plane, **BIG)
    gen = torch.Generator().manual_seed(rank)
    xs = [(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 4, (n,), generator=gen)).to(dtype)
          for n in (1, 5, 300, 4099)]
    order = list(range(len(xs)))[::(-1 if rank % 2 else 1)]
    handles = {i: hvd.allreduce_async(xs[i], op=hvd.Sum, name=f"tdet.{i}") for i in order}
    everyone = [hvd.allgather(x[None], name=f"tdet.all.{i}") for i, x in enumerate(xs)]
    for i in range(len(xs)):
        expected = everyone[i][0].clone()
        for v in everyone[i][1:]:
            expected = expected + v
        assert torch.equal(hvd.synchronize(handles[i]), expected), i
    x = xs[3][:size * 7].clone()
    got = hvd.reducescatter(x, op=hvd.Sum, name="tdet.rs")
    expected = everyone[3][0][:size * 7].clone()
    for v in everyone[3][1:]:
        expected = expected + v[:size * 7]
    assert torch.equal(got, expected[rank * 7:(rank + 1) * 7])


def _adasum(reinit, rank: int, **settings: object) -> list[np.ndarray]:
    reinit(deterministic=True, **settings)
    rng = np.random.default_rng(rank)
    xs = [rng.normal(size=n) for n in (3, 1000, 77, 4099, 10, 513)]  # float64: a coefficient's last bits show
    handles = [hvd_core.allreduce_async(x, op=hvd_core.Adasum, name=f"ada.{i}") for i, x in enumerate(xs)]
    return [hvd_core.synchronize(h) for h in handles]


def test_adasum_gives_the_same_bits_fused_or_not(reinit, rank: int, size: int) -> None:
    if size & (size - 1):
        with pytest.raises(ValueError, match="power-of-two"):  # Adasum's own rule at -n 3
            _adasum(reinit, rank, **BIG)
        return
    a = _adasum(reinit, rank, **BIG)
    b = _adasum(reinit, rank, **SMALL)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


def _train(reinit, rank: int, **settings: object) -> list[np.ndarray]:
    reinit(deterministic=True, **settings)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(6):  # a difference in any step's bits stays in the weights
        x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    weights = [p.detach().numpy().copy() for p in model.parameters()]
    assert hvd.check_replicas(model) == len(weights)  # bit-identical on every rank
    return weights


@pytest.mark.parametrize("plane", PLANES)
def test_training_gives_the_same_bits_under_very_different_fusion_and_chunk_settings(reinit, plane: str,
                                                                                     rank: int) -> None:
    a = _train(reinit, rank, cpu_operations=plane, **BIG)
    b = _train(reinit, rank, cpu_operations=plane, **SMALL)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("plane", PLANES)
def test_training_gives_the_same_bits_with_the_autotune_switching_settings(reinit, plane: str, rank: int) -> None:
    a = _train(reinit, rank, cpu_operations=plane, **SMALL)
    b = _train(reinit, rank, cpu_operations=plane, autotune=True, autotune_warmup_samples=1,
               autotune_steps_per_sample=2, autotune_bayes_opt_max_samples=3)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()
