"""root_rank is a rank of the whole job, also with process_set= (Horovod's meaning): every rooted function
of the core and of hvdlite.torch, over the set of every rank but 0 ([1, 2] at -n 3, [1, 2, 3] at -n 4), with
every root; a root outside the set fails the op with the same ValueError on every member."""
from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import pytest
import torch

import hvdlite as core
import hvdlite.torch as hvd
from exact import same
from root_sets import MEMBERS, value

MPI_SIZES = (3, 4)
SPAWN_TIMEOUT = 300
R, N = hvd.rank(), hvd.size()


def core_rooted(ps: Any) -> dict[str, Callable[[int], Any]]:
    """Each rooted function of the core: root -> this rank's result (an array)."""
    def in_place(root: int) -> np.ndarray:
        a = value(R)
        core.broadcast_(a, root, process_set=ps)
        return a

    def async_in_place(root: int) -> np.ndarray:
        a = value(R)
        core.synchronize(core.broadcast_async_(a, root, process_set=ps))
        return a
    return {
        "broadcast": lambda root: core.broadcast(value(R), root, process_set=ps),
        "broadcast_": in_place,
        "broadcast_async": lambda root: core.synchronize(core.broadcast_async(value(R), root, process_set=ps)),
        "broadcast_async_": async_in_place,
        "broadcast_object": lambda root: core.broadcast_object({"v": value(R)}, root, process_set=ps)["v"],
    }


def torch_rooted(ps: Any) -> dict[str, Callable[[int], Any]]:
    """Each rooted function of hvdlite.torch: root -> this rank's result (an array)."""
    def t() -> torch.Tensor:
        return torch.from_numpy(value(R))

    def in_place(root: int) -> np.ndarray:
        x = t()
        hvd.broadcast_(x, root, process_set=ps)
        return x.numpy()

    def async_in_place(root: int) -> np.ndarray:
        x = t()
        hvd.synchronize(hvd.broadcast_async_(x, root, process_set=ps))
        return x.numpy()

    def parameters(root: int) -> np.ndarray:
        params = {"w": t(), "b": t()[0].clone()}
        hvd.broadcast_parameters(params, root, process_set=ps)
        same(params["b"].numpy(), value(root)[0], "broadcast_parameters b")
        return params["w"].numpy()

    def optimizer_state(root: int) -> np.ndarray:
        w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
        opt = torch.optim.SGD([w], lr=0.1 * (R + 1), momentum=0.9)
        w.grad = t()
        opt.step()  # momentum buffer = this rank's value
        hvd.broadcast_optimizer_state(opt, root, process_set=ps)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * (root + 1)), opt.param_groups[0]["lr"]
        return opt.state[w]["momentum_buffer"].numpy()

    def gradient(root: int) -> np.ndarray:
        x = t().requires_grad_()
        out = hvd.broadcast(x, root, process_set=ps)
        same(out.detach().numpy(), value(root), "differentiable broadcast forward")
        (out * float(R + 1)).sum().backward()  # d/dx: the set's average of (rank + 1) on the root, else 0
        want = np.full((2, 3), np.mean([r + 1 for r in MEMBERS])) if R == root else np.zeros((2, 3))
        same(x.grad.numpy(), want, "differentiable broadcast gradient")
        return out.detach().numpy()
    return {
        "torch.broadcast": lambda root: hvd.broadcast(t(), root, process_set=ps).numpy(),
        "torch.broadcast_": in_place,
        "torch.broadcast_async": lambda root: hvd.synchronize(hvd.broadcast_async(t(), root, process_set=ps)).numpy(),
        "torch.broadcast_async_": async_in_place,
        "torch.broadcast_object": lambda root: hvd.broadcast_object({"v": value(R)}, root, process_set=ps)["v"],
        "torch.broadcast_parameters": parameters,
        "torch.broadcast_optimizer_state": optimizer_state,
        "torch.broadcast (gradient)": gradient,
    }


def all_rooted(ps: Any) -> dict[str, Callable[[int], Any]]:
    return {**core_rooted(ps), **torch_rooted(ps)}


def test_every_rooted_function_broadcasts_from_the_job_rank(ps: Any) -> None:
    if R not in MEMBERS:
        return
    for name, fn in all_rooted(ps).items():
        for root in MEMBERS:
            same(np.asarray(fn(root)), value(root), f"{name} root_rank={root} over {MEMBERS}")


@pytest.mark.parametrize("root", [0, N, -1])
def test_a_root_outside_the_set_fails_on_every_member(ps: Any, root: int) -> None:
    if R not in MEMBERS:
        return
    for name, fn in all_rooted(ps).items():
        with pytest.raises(ValueError) as info:
            fn(root)
        text = str(info.value)
        assert f"the set's ranks are {MEMBERS}" in text and f"{root}" in text, f"{name}: {text}"
    # and the set goes on: generated names agree on every member after the failures
    same(core.broadcast(value(R), MEMBERS[-1], process_set=ps), value(MEMBERS[-1]), "after the failures")


def test_members_passing_different_roots_fail_together(ps: Any) -> None:
    """One member passes a root outside the set, the others a member: every member gets the ValueError."""
    if R not in MEMBERS:
        return
    root = 0 if R == MEMBERS[-1] else MEMBERS[0]
    with pytest.raises(ValueError, match=rf"rank {MEMBERS[-1]}: 0\); the set's ranks are"):
        core.broadcast(value(R), root, process_set=ps)
    same(core.broadcast(value(R), MEMBERS[0], process_set=ps), value(MEMBERS[0]), "after")


def test_global_set_roots_unchanged() -> None:
    for root in range(N):
        same(core.broadcast(value(R), root), value(root), f"global root {root}")
        same(hvd.broadcast(torch.from_numpy(value(R)), root).numpy(), value(root), f"torch global root {root}")
    with pytest.raises(ValueError, match=re.escape(f"the set's ranks are {list(range(N))}")):
        core.broadcast(value(R), N)
