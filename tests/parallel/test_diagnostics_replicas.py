"""hvd.check_replicas on numpy collections, torch modules and optimizers: equal replicas pass; a perturbed
parameter, an unsynchronised BatchNorm buffer or optimizer state is named on every rank with the ranks that
differ and the largest absolute difference; DistributedOptimizer(check_replicas_every_steps=N)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdlite as hvd_core
import hvdlite.torch as hvd

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 240


def _same_everywhere(error: BaseException) -> None:
    texts = hvd_core.allgather_object(str(error))
    assert len(set(texts)) == 1, texts


def _model() -> torch.nn.Module:
    torch.manual_seed(1234 + hvd.rank())  # different on every rank until broadcast
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def test_equal_numpy_collections_pass_and_count_every_tensor(rank: int) -> None:
    data = {"a": np.arange(6.0).reshape(2, 3), "b": [np.ones(2, np.int32), 3.5], "c": ({"d": np.zeros(0)},)}
    assert hvd_core.check_replicas(data) == 4


def test_numpy_difference_is_exact_and_names_the_first_differing_tensor(rank: int, size: int) -> None:
    last = size - 1
    data = {"same": np.ones(3), "odd": np.full(4, 2.0) + (rank == last) * np.array([0, 0.5, -1.75, 0]),
            "also": np.zeros(1) + (rank == 0)}
    with pytest.raises(hvd_core.ReplicaDivergenceError) as info:
        hvd_core.check_replicas(data)
    err = info.value
    assert err.tensor == "odd" and err.ranks == (last,) and err.max_abs_diff == 1.75, str(err)
    assert err.tensors == ("odd", "also"), err.tensors
    assert f"'odd' (float64, shape (4,)) differs on rank(s) [{last}] from rank(s) {list(range(last))}; " \
           f"largest absolute difference 1.75 (rank {last}). 1 more tensor(s) differ: 'also'." in str(err), str(err)
    _same_everywhere(err)


def test_different_tensor_sets_are_named(rank: int, size: int) -> None:
    with pytest.raises(hvd_core.ReplicaDivergenceError, match=r"the ranks hold different tensors \(rank 0 holds "
                                                              r"1 tensors, rank 1 holds 2\)"):
        hvd_core.check_replicas([np.ones(2)] * (1 if rank == 0 else 2))


def test_torch_module_with_a_parameter_perturbed_on_one_rank(rank: int, size: int) -> None:
    model = _model()
    assert hvd.check_replicas(model) == len(model.state_dict())
    last = size - 1
    before = model[2].weight[1, 3].item()
    with torch.no_grad():
        if rank == last:
            model[2].weight[1, 3] += 0.25
    with pytest.raises(hvd.ReplicaDivergenceError) as info:
        hvd.check_replicas(model)
    err = info.value
    expected = abs(model[2].weight[1, 3].item() - before) if rank == last else None  # float32 rounding
    assert err.tensor == "2.weight" and err.ranks == (last,) and err.tensors == ("2.weight",), str(err)
    diff = hvd_core.allgather_object(expected)[last]
    assert err.max_abs_diff == diff and 0.24 < diff < 0.26, (err.max_abs_diff, diff)
    _same_everywhere(err)


def test_torch_batchnorm_buffer_left_unsynchronised_is_named(rank: int, size: int) -> None:
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(rank))  # each rank its own shard
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    assert hvd.check_replicas(optimizer) > 0  # parameters and state agree: the gradients were averaged
    with pytest.raises(hvd.ReplicaDivergenceError) as info:
        hvd.check_replicas(model)
    err = info.value
    means = hvd_core.allgather(model[1].running_mean.numpy()[None].astype(np.float64))
    assert err.tensor == "1.running_mean" and err.ranks == tuple(range(1, size)), str(err)
    assert err.max_abs_diff == max(float(np.max(np.abs(means[r] - means[0]))) for r in range(1, size)) > 0
    assert set(err.tensors) == {"1.running_mean", "1.running_var"}, err.tensors
    _same_everywhere(err)


def test_torch_optimizer_state_perturbed_on_one_rank(rank: int, size: int) -> None:
    model = _model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    model.eval()  # BatchNorm uses its (equal) running statistics
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 5, generator=torch.Generator().manual_seed(rank))).sum().backward()
        optimizer.step()
    assert hvd.check_replicas(model) == len(model.state_dict())
    if rank == 0:
        optimizer.state[model[0].bias]["momentum_buffer"][2] += 1.0
    with pytest.raises(hvd.ReplicaDivergenceError) as info:
        hvd.check_replicas(optimizer)
    assert info.value.tensor == "0.bias state.momentum_buffer", str(info.value)
    # the odd one out: rank 0 against the others (at -n 2 a tie, and the group of rank 0 is the reference)
    assert info.value.ranks == ((1,) if size == 2 else (0,)), str(info.value)


def test_distributed_optimizer_checks_every_n_steps(rank: int, size: int) -> None:
    model = _model()
    model.eval()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), check_replicas_every_steps=2)
    last = size - 1
    for step in range(1, 5):
        optimizer.zero_grad()
        model(torch.ones(2, 5)).sum().backward()
        if step == 3 and rank == last:
            with torch.no_grad():
                model[0].weight[0, 0] += 1.0  # drifts after step 2's check; step 4's check finds it
        if step < 4:
            optimizer.step()
        else:
            with pytest.raises(hvd.ReplicaDivergenceError) as info:
                optimizer.step()
            assert info.value.tensor == "0.weight" and info.value.ranks == (last,), str(info.value)
