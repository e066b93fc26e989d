"""DistributedOptimizer's gradient buckets, no_sync() and comm hooks, and ZeroRedundancyOptimizer's no_sync()
and its handling of parameters no rank has a gradient for: each against single-process training on the whole
batch (every rank computes the reference itself), with identical weights on every rank."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn

import hvdlite.torch as hvd
from hvdlite.torch import comm_hooks

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 300
R, N = hvd.rank(), hvd.size()
B = 4
loss_fn = nn.MSELoss()


@pytest.fixture(autouse=True)
def float64() -> Iterator[None]:
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def model_of(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def check(model: nn.Module, ref: nn.Module, what: str, tol: float = 1e-10) -> None:
    diff = (flat(model) - flat(ref)).abs().max().item()
    assert diff <= tol, f"{what}: max difference {diff} > {tol} from single-process training"
    every = hvd.allgather(flat(model).unsqueeze(0))
    assert torch.equal(every, flat(model).expand_as(every)), f"{what}: weights differ between ranks"


def data(steps: int, micro: int = 1, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step s's global batch: micro * N * B rows; micro-batch m of rank r is rows [(m*N + r)*B, ...+B)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro * N * B, 5, generator=g), torch.randn(micro * N * B, 3, generator=g))
            for _ in range(steps)]


def mine(x: torch.Tensor, m: int) -> torch.Tensor:
    return x[(m * N + R) * B:(m * N + R + 1) * B]


def reference(make_opt: Callable, batches: list, before_step: Callable = lambda m: None) -> nn.Module:
    ref = model_of()
    opt = make_opt(ref.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        before_step(ref)
        opt.step()
    return ref


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def train_distributed(batches: list, comm_hook: Any = None, **kwargs: Any) -> tuple[nn.Module, Any]:
    """DistributedOptimizer(sgd) over model_of(), one step per batch on this rank's rows."""
    model = model_of()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(), **kwargs)
    if comm_hook is not None:
        opt.register_comm_hook(*comm_hook)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(mine(x, 0)), mine(y, 0)).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_gradients_are_views_of_agreed_buckets(overlap: str, reinit: Callable[..., None]) -> None:
    reinit(gradient_overlap=overlap, fusion_threshold_bytes=600)  # several buckets: 600 bytes = 75 float64
    batches = data(4)
    ref = reference(sgd, batches)
    model = model_of()
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    for step, (x, y) in enumerate(batches):
        if step == 2:
            opt.zero_grad(set_to_none=False)  # gradients stay views; backward adds into them in place
        else:
            opt.zero_grad()
        loss_fn(model(mine(x, 0)), mine(y, 0)).backward()
        opt.step()
    check(model, ref, f"buckets (overlap {overlap})")
    layout = [(b.name, [tuple(p.shape) for p in b.params]) for b in opt._buckets.buckets]
    assert len(layout) >= 3, layout
    assert all(lay == layout for lay in hvd.allgather_object(layout)), "bucket layouts differ between ranks"
    # the first backward's order: the last layer's gradients first
    assert [tuple(p.shape) for p in opt._buckets.buckets[0].params][0] in {(3,), (3, 16)}, layout
    for bucket in opt._buckets.buckets:
        assert sum(p.numel() * 8 for p in bucket.params) <= 600 or len(bucket.params) == 1
        for p, view in zip(bucket.params, bucket.split(bucket.grads)):
            assert p.grad.data_ptr() == view.data_ptr(), f"{bucket.name}: gradient is not a view of its bucket"


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_groups_are_bucket_boundaries(overlap: str, reinit: Callable[..., None]) -> None:
    """groups=: each unit is one bucket whatever the fusion cap, a parameter outside every group one of its
    own; training equals single-process training (with a comm hook too, overlapping)."""
    reinit(gradient_overlap=overlap, fusion_threshold_bytes=600)  # w1 alone is 2048 bytes
    batches = data(3, seed=5)
    ref = reference(sgd, batches)
    model = model_of()
    w0, b0, w1, b1, w2, b2 = model.parameters()
    units = ([w0, b2], [w1, b1])
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(), groups=units)
    if overlap == "on":
        opt.register_comm_hook(None, comm_hooks.allreduce_hook)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(mine(x, 0)), mine(y, 0)).backward()
        opt.step()
    check(model, ref, f"groups= (overlap {overlap})")
    got = {frozenset(map(id, b.params)) for b in opt._buckets.buckets}
    assert got == {frozenset(map(id, u)) for u in units + ([b0], [w2])}, [b.name for b in opt._buckets.buckets]


def test_replaced_grad_data_swap_frozen_and_model_to() -> None:
    """A replaced p.grad, a .data swap, a parameter frozen then unfrozen, and model.to(float32) after
    wrapping: every step still equals single-process training."""
    batches = data(6, seed=3)

    def run(model: nn.Module, opt: torch.optim.Optimizer, x_of: Callable, distributed: bool) -> None:
        for step, (x, y) in enumerate(batches):
            first = model[0]
            first.weight.requires_grad_(step != 2)  # frozen in step 2 only
            if step == 4:
                model.to(torch.float32)
            if step == 1:
                with torch.no_grad():
                    model[2].bias.data = model[2].bias.data.clone()  # a .data swap
            opt.zero_grad()
            xs, ys = x_of(x), x_of(y)
            loss_fn(model(xs.to(first.bias.dtype)), ys.to(first.bias.dtype)).backward()
            if step == 3:
                model[4].bias.grad = model[4].bias.grad.clone()  # a replaced gradient
            opt.step()

    ref = model_of()
    run(ref, torch.optim.SGD(ref.parameters(), lr=0.1), lambda t: t, False)
    model = model_of()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    run(model, opt, lambda t: mine(t, 0), True)
    check(model, ref, "replaced grad, .data swap, frozen, model.to()", tol=1e-5)


@pytest.mark.parametrize("zero", [False, True], ids=["DistributedOptimizer", "ZeroRedundancyOptimizer"])
def test_no_sync_equals_whole_accumulated_batch(zero: bool) -> None:
    micro = 3
    batches = data(3, micro, seed=7)
    ref = reference(sgd, batches)
    model = model_of()
    if zero:
        opt: Any = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                                               weight_decay=0.01)
    else:
        opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        with opt.no_sync():
            for m in range(micro - 1):
                (loss_fn(model(mine(x, m)), mine(y, m)) / micro).backward()
        loss_fn(model(mine(x, micro - 1)), mine(y, micro - 1)).div(micro).backward()
        opt.step()
    check(model, ref, "no_sync accumulation")
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        opt.set_backward_passes_per_step(2)
        with opt.no_sync():
            pass
    opt.set_backward_passes_per_step(1)


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"])
def test_shipped_hooks(hook: str) -> None:
    """Each rank's gradients are N * k / 4 for small integers k: exact in float16 and bfloat16, and so is
    their average; the hooks must give exactly that average on every rank."""
    def grads_of(r: int, p_index: int, shape: torch.Size) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * r + p_index)
        return N * torch.randint(-8, 8, shape, generator=g).double() / 4

    model = model_of()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    opt.register_comm_hook(None, getattr(comm_hooks, hook))
    with pytest.raises(RuntimeError, match="only once"):
        opt.register_comm_hook(None, comm_hooks.allreduce_hook)
    params = list(model.parameters())
    expected = [p.detach().clone() for p in params]
    for step in range(2):  # the second step runs on the agreed layout (submitted from backward if overlapping)
        opt.zero_grad()
        sum((p * grads_of(R, i, p.shape)).sum() for i, p in enumerate(params)).backward()
        opt.step()
        for i, p in enumerate(params):
            average = sum(grads_of(r, i, p.shape) for r in range(N)) / N
            expected[i] = expected[i] - average
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), expected[i]), (hook, i, (p.detach() - expected[i]).abs().max())
    every = hvd.allgather(flat(model).unsqueeze(0))
    assert torch.equal(every, flat(model).expand_as(every))


def test_custom_hook_sees_the_protocol() -> None:
    calls: list[tuple] = []

    def hook(state: dict, bucket: Any) -> torch.futures.Future:
        state["calls"] += 1
        buf = bucket.buffer()
        assert buf.dim() == 1 and buf.is_contiguous()
        for g, p in zip(bucket.gradients(), bucket.parameters()):
            assert g.shape == p.shape and g.data_ptr() >= buf.data_ptr()
        calls.append((bucket.index(), bucket.is_last(), bucket.name, buf.numel()))
        total = hvd.allreduce(buf, op=hvd.Sum, name=bucket.name + ".sum", process_set=bucket.process_set)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(total / N)  # a new tensor: the optimizer writes it into the bucket
        return fut

    batches = data(3, seed=11)
    ref = reference(sgd, batches)
    state = {"calls": 0}
    model, opt = train_distributed(batches, comm_hook=(state, hook))
    check(model, ref, "custom hook", tol=1e-12)
    nb = len(opt._buckets.buckets)
    assert state["calls"] == 3 * nb
    assert sorted(c[0] for c in calls) == sorted(list(range(nb)) * 3)
    assert all(last == (index == nb - 1) for index, last, _, _ in calls)
    assert len({c[2] for c in calls}) == nb


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_zero_skips_parameters_without_gradient_anywhere(optimizer: str) -> None:
    """A branch no rank uses: torch leaves it alone (no weight decay, no momentum); so must the shards."""
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
            "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)}[optimizer]

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(5)
            self.body, self.head, self.unused = nn.Linear(5, 6), nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x)))

    batches = data(4, seed=13)
    ref = TwoHeads()
    ref_opt = make(ref.parameters())
    for x, y in batches:
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    model = TwoHeads()
    start = flat(model.unused)
    cls, kwargs = (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)) if optimizer == "adamw" else \
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01))
    opt = hvd.ZeroRedundancyOptimizer(model.parameters(), cls, **kwargs)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(mine(x, 0)), mine(y, 0)).backward()
        opt.step()
    assert torch.equal(flat(model.unused), start), "a parameter without gradients anywhere was moved"
    check(model, ref, f"ZeRO {optimizer} with an unused head", tol=1e-10)


def test_process_set_buckets() -> None:
    """Ranks 0 and 1 train over their own set (at -n 3 rank 2 trains alone over another): each set equals
    single-process training on its members' batches."""
    pair = hvd.add_process_set([0, 1]) if N > 2 else hvd.global_process_set  # at -n 2: the global set
    rest = hvd.add_process_set([2]) if N > 2 else None
    try:
        members = [0, 1] if R < 2 else [2]
        pset = pair if R < 2 else rest
        batches = data(3, seed=17)
        ref = model_of()
        ref_opt = sgd(ref.parameters())
        for x, y in batches:
            ref_opt.zero_grad()
            loss_fn(ref(torch.cat([x[r * B:(r + 1) * B] for r in members])),
                    torch.cat([y[r * B:(r + 1) * B] for r in members])).backward()
            ref_opt.step()
        model, opt = train_distributed(batches, process_set=pset)
        diff = (flat(model) - flat(ref)).abs().max().item()
        assert diff <= 1e-10, f"process set {members}: max difference {diff}"
        if R < 2:
            every = hvd.allgather(flat(model).unsqueeze(0), process_set=pair)
            assert torch.equal(every[0], every[1]), "weights differ within the set"
            assert all(b.name.startswith(f"grads.ps{pair.process_set_id}.") for b in opt._buckets.buckets)
    finally:
        if rest is not None:
            hvd.remove_process_set(pair)
            hvd.remove_process_set(rest)


@pytest.mark.parametrize("groups", [None, 2], ids=["buckets", "groups=2"])
def test_custom_compressor_gets_each_gradient_shaped(groups: Any) -> None:
    """compression= with a Horovod-style compressor: it sees each gradient with its parameter's shape (not the
    flat bucket), and training equals single-process training; with and without groups=."""
    shapes: set[tuple] = set()

    class Halve(hvd.Compressor):  # sends half the value, restores it: exact in binary floating point
        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
            shapes.add(tuple(tensor.shape))
            return tensor / 2, None

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
            return tensor * 2

    batches = data(2, seed=19)
    ref = reference(sgd, batches)
    model, _ = train_distributed(batches, compression=Halve, groups=groups)
    check(model, ref, f"custom compressor (groups={groups})", tol=1e-12)
    assert shapes == {tuple(p.shape) for p in model.parameters()}, shapes
