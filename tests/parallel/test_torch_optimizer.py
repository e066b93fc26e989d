"""hvdlite.torch.DistributedOptimizer equals single-process training on the concatenated batch, with
identical weights on every rank; misuse errors, unused/toggled/sparse parameters, SyncBatchNorm, the
broadcast helpers and join. Every test runs three times: gradient_overlap on (allreduces started from
backward), off (all started at step()), and with every tensor staged through a host copy (STAGE_HOST_COPIES).
Every rank also computes the single-process reference itself, on the concatenation of all ranks' batches."""
from __future__ import annotations

import os

import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn

import hvdlite.torch as hvd
from hvdlite.torch import tensors

MPI_SIZES = (2, 3)
SPAWN_TIMEOUT = 420
VARIANTS = ("", "HOROVOD_CPU_OPERATIONS=GLOO")  # again on the torch.distributed (gloo) data plane
R, N = hvd.rank(), hvd.size()
B, STEPS = 4, 3
MODES: dict[str, dict[str, Any]] = {"overlap-on": {"gradient_overlap": "on"},
                                    "overlap-off": {"gradient_overlap": "off"}, "staged": {}}
if os.environ.get("HOROVOD_CPU_OPERATIONS", "").lower() == "gloo":  # the gloo plane ignores host staging
    del MODES["staged"]
loss_fn = nn.MSELoss()


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest, reinit: Callable[..., None]) -> Iterator[str]:
    tensors.STAGE_HOST_COPIES = request.param == "staged"  # every tensor through a host copy
    reinit(**MODES[request.param])
    torch.set_default_dtype(torch.float64)
    yield request.param
    torch.set_default_dtype(torch.float32)
    tensors.STAGE_HOST_COPIES = False


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-10) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"{what}: max difference {diff} > {tol}"


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical_everywhere(model: nn.Module, what: str) -> None:
    w = flat(model)
    every = hvd.allgather(w.unsqueeze(0))
    assert torch.equal(every, w.expand_as(every)), f"{what}: weights differ between ranks"


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def batches(steps: int, per_rank: int, seed: int = 0) -> list:
    """Global batches: step s's batch is the concatenation of every rank's per_rank rows."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(N * per_rank, 5, generator=g), torch.randn(N * per_rank, 3, generator=g))
            for _ in range(steps)]


def mine(batch: tuple, per_rank: int, part: int = 0, parts: int = 1) -> tuple:
    """This rank's rows of a global batch (optionally one of `parts` micro-batches)."""
    x, y = batch
    lo = R * per_rank
    step = per_rank // parts
    return x[lo + part * step: lo + (part + 1) * step], y[lo + part * step: lo + (part + 1) * step]


def sgd(params):  # noqa: ANN001, ANN201
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def adam(params):  # noqa: ANN001, ANN201
    return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95))


def test_overlap_setting_reaches_the_optimizer(mode: str) -> None:
    probe = hvd.DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    expected = {"overlap-on": True, "overlap-off": False}.get(mode, probe.overlap)
    assert probe.overlap is expected, (mode, probe.overlap)


EQUIVALENCE = {
    "sgd momentum": dict(make_opt=sgd),
    "adam": dict(make_opt=adam),
    "overlap toggled between steps": dict(make_opt=adam, toggle_overlap=True),
    "adamw passes=2": dict(make_opt=lambda p: torch.optim.AdamW(p, lr=0.01), passes=2),
    "sgd passes=2": dict(make_opt=sgd, passes=2),
    "groups=2": dict(make_opt=sgd, groups=2),
    "sum with predivide": dict(make_opt=lambda p: torch.optim.SGD(p, lr=0.1), gradient_predivide_factor=2.0),
    "clipping": dict(make_opt=sgd, clip=0.05),
    "fp16 compression": dict(make_opt=sgd, tol=2e-3, compression=hvd.Compression.fp16),
    "bf16 compression": dict(make_opt=sgd, tol=2e-2, compression=hvd.Compression.bf16),
    "groups=2 fp16 predivide": dict(make_opt=sgd, groups=2, tol=2e-3, compression=hvd.Compression.fp16,
                                    gradient_predivide_factor=2.0),
}


@pytest.mark.parametrize("case", list(EQUIVALENCE))
def test_equals_single_process_training(case: str, mode: str) -> None:
    kwargs = dict(EQUIVALENCE[case])
    make_opt = kwargs.pop("make_opt")
    passes, clip, tol = kwargs.pop("passes", 1), kwargs.pop("clip", None), kwargs.pop("tol", 1e-10)
    toggle_overlap = kwargs.pop("toggle_overlap", False)
    data = batches(STEPS, B * passes)
    ref = mlp(1)
    ref_opt = make_opt(ref.parameters())
    for x, y in data:
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        if clip:
            nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
    model = mlp(1 if R == 0 else 100 + R)  # the root starts like the reference; broadcast fixes the rest
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    close(flat(model), flat(mlp(1)), f"{case}: broadcast_parameters(state_dict)", 0)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    assert isinstance(opt, type(ref_opt)) and type(opt).__name__ == type(ref_opt).__name__
    for batch in data:
        if toggle_overlap:  # switch between reducing from backward hooks and at step(), every step
            opt.overlap = not opt.overlap
        opt.zero_grad()
        for part in range(passes):
            x, y = mine(batch, B * passes, part, passes)
            (loss_fn(model(x), y) / passes).backward()
        if clip:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    close(flat(model), flat(ref), f"{case}: weights equal single-process training", tol)
    assert_identical_everywhere(model, case)


def test_misuse_errors(mode: str) -> None:
    """The clipping warning, zero_grad misuse, too many passes, bad names, re-wrapping, Adasum; and
    gradients_pending along the way."""
    model = mlp(1)
    opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    x, y = mine(batches(1, B)[0], B)
    assert not opt.gradients_pending
    loss_fn(model(x), y).backward()
    assert opt.gradients_pending
    with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        loss_fn(model(x), y).backward()
    opt.synchronize()
    assert not opt.gradients_pending
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught
    opt.zero_grad()
    opt.set_backward_passes_per_step(2)
    loss_fn(model(x), y).backward()  # the first of two passes: as in Horovod, zero_grad() still refuses
    assert opt.gradients_pending
    with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
        opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    opt.set_backward_passes_per_step(1)
    params = list(model.named_parameters())
    for bad, text in (([params[0], params[0]] + params[1:], "Found duplicates: 0.weight"),
                      (params[1:], "were not named"), ([p for _, p in params], r"tuples \(name, parameter\)")):
        with pytest.raises(ValueError, match=text):
            hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=bad)
    rewrapped = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    for _ in range(2):  # the first optimizer is still alive: only the newest one's hooks may reduce
        rewrapped.zero_grad()
        loss_fn(model(x), y).backward()
        assert rewrapped.gradients_pending and not opt.gradients_pending
        rewrapped.step()
        assert not rewrapped.gradients_pending
    assert not opt._buckets.inflight and not opt._sparse
    assert_identical_everywhere(model, "re-wrapped model")
    if N & (N - 1):  # DistributedOptimizer(op=Adasum) itself: test_torch_adasum.py
        with pytest.raises(ValueError, match="power-of-two"):
            hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Adasum)


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.head, self.late = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(5, 3)
        self.late.requires_grad_(False)  # frozen at construction, unfrozen later

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.b(x) if use_b else self.a(x)
        out = self.head(torch.tanh(h))
        return out + self.late(x) if self.late.weight.requires_grad else out


def test_unused_parameters_and_requires_grad_toggles(mode: str) -> None:
    def branch_plan(step: int, r: int) -> bool:
        return (step + r) % 2 == 1  # ranks disagree on which branch runs

    def set_trainable(model: Branches, step: int) -> None:
        model.head.requires_grad_(step != 1)  # frozen in step 1 only
        model.late.requires_grad_(step >= 2)

    data = batches(4, B, seed=5)
    ref = Branches()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = Branches()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step, (bx, by) in enumerate(data):
        set_trainable(ref, step)
        ref_opt.zero_grad()
        sum(loss_fn(ref(bx[r * B:(r + 1) * B], branch_plan(step, r)), by[r * B:(r + 1) * B])
            for r in range(N)).div(N).backward()
        ref_opt.step()
        set_trainable(model, step)
        opt.zero_grad()
        x, y = mine((bx, by), B)
        loss_fn(model(x, branch_plan(step, R)), y).backward()
        opt.step()
    close(flat(model), flat(ref), "unused and toggled parameters")
    assert_identical_everywhere(model, "unused and toggled parameters")


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.emb, self.out = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


def test_gradient_predivide_factor_divides_before_the_sum() -> None:
    """gradient_predivide_factor=f divides each rank's gradient by f before the sum and multiplies the average by
    f after it (core.frontend.gradient_scales, which TensorFlow's tape shares; test_tf_policy.py): a float16 sum
    that overflows without it stays finite and exact with it, in a bucket and in a groups= unit."""
    value = 49152.0  # 1.5 * 2**15: exact in float16, and divided by 2 or 3; twice it overflows float16 (65504)
    for factor, groups, want in ((float(N), None, value), (float(N), 1, value), (1.0, None, float("inf"))):
        p = nn.Parameter(torch.zeros(4, dtype=torch.float32))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[(f"pf.{factor}.{groups}", p)],
                                       compression=hvd.Compression.fp16, gradient_predivide_factor=factor,
                                       groups=groups)
        for _ in range(2):  # the first step agrees on the bucket layout; the second reduces from the hooks
            opt.zero_grad()
            (p * value).sum().backward()
            opt.synchronize()
            assert torch.equal(p.grad, torch.full((4,), want)), (factor, groups, p.grad)


@pytest.mark.parametrize("as_dense", [False, True], ids=["sparse", "sparse_as_dense"])
def test_sparse_gradients(as_dense: bool, mode: str) -> None:
    g = torch.Generator().manual_seed(9)
    tokens = [torch.randint(0, 20, (N * B, 3), generator=g) for _ in range(STEPS)]
    targets = [torch.randn(N * B, 1, generator=g) for _ in range(STEPS)]
    ref = Embed()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for idx, y in zip(tokens, targets):
        ref_opt.zero_grad()
        loss_fn(ref(idx), y).backward()
        ref_opt.step()
    model = Embed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), sparse_as_dense=as_dense)
    for idx, y in zip(tokens, targets):
        opt.zero_grad()
        loss_fn(model(idx[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        assert model.emb.weight.grad.is_sparse
        opt.step()
    close(flat(model), flat(ref), f"sparse embedding (sparse_as_dense={as_dense})")
    assert_identical_everywhere(model, "sparse embedding")


def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(mode: str) -> None:
    torch.manual_seed(6)
    ref = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
    model = nn.Sequential(nn.Linear(5, 4), hvd.SyncBatchNorm(4), nn.Tanh(), nn.Linear(4, 3))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for x, y in batches(STEPS, B, seed=11):
        ref_opt.zero_grad()
        ref_out = ref(x)
        loss_fn(ref_out, y).backward()
        ref_opt.step()
        opt.zero_grad()
        xm, ym = x[R * B:(R + 1) * B], y[R * B:(R + 1) * B]
        out = model(xm)
        close(out, ref_out[R * B:(R + 1) * B].detach(), "SyncBatchNorm forward")
        loss_fn(out, ym).backward()
        opt.step()
    close(flat(model), flat(ref), "SyncBatchNorm training")
    close(model[1].running_mean, ref[1].running_mean, "SyncBatchNorm running_mean")
    close(model[1].running_var, ref[1].running_var, "SyncBatchNorm running_var")
    assert int(model[1].num_batches_tracked) == STEPS
    model.eval()
    ref.eval()
    close(model(x[:2]), ref(x[:2]), "SyncBatchNorm eval")


def test_broadcast_parameters_forms(mode: str) -> None:
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    torch.manual_seed(20 + R)
    for p in bn.parameters():
        p.data.normal_()
    bn[1].running_mean.fill_(R)
    bn[1].num_batches_tracked.fill_(7 + R)
    extra = {"scalar": 1.5 * (R + 1), "w": torch.full((2,), float(R))}
    hvd.broadcast_parameters(bn.state_dict(), root_rank=N - 1)
    hvd.broadcast_parameters(extra, root_rank=N - 1)
    assert bn[1].num_batches_tracked.item() == 7 + N - 1
    assert torch.equal(bn[1].running_mean, torch.full((3,), N - 1.0))
    assert extra["scalar"] == 1.5 * N and torch.equal(extra["w"], torch.full((2,), N - 1.0))
    assert_identical_everywhere(bn, "broadcast_parameters(state_dict)")
    for p in bn.parameters():
        p.data.fill_(R)
    hvd.broadcast_parameters(bn.named_parameters(), root_rank=1)
    assert all(torch.equal(p, torch.ones_like(p)) for p in bn.parameters())
    for p in bn.parameters():
        p.data.fill_(R)
    hvd.broadcast_parameters(list(bn.parameters()), root_rank=0)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in bn.parameters())


def test_broadcast_optimizer_state_fresh_and_lazy(mode: str) -> None:
    model = mlp(1)
    before = flat(model)
    fresh = torch.optim.Adam(model.parameters(), lr=0.001 * (R + 1), betas=(0.5 + 0.1 * R, 0.99))
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert fresh.param_groups[0]["lr"] == 0.001 and fresh.param_groups[0]["betas"] == (0.5, 0.99)
    assert isinstance(fresh.param_groups[0]["betas"], tuple)
    for p in model.parameters():  # Horovod's start: one local step on zero gradients (the weights stay)
        assert fresh.state[p]["step"].item() == 1 and not fresh.state[p]["exp_avg"].any()
        assert p.grad is not None and not p.grad.any()
    assert torch.equal(flat(model), before)
    if R == 0:  # the root steps alone: its state moves on, the others' does not
        fresh.zero_grad()
        loss_fn(model(torch.ones(2, 5)), torch.zeros(2, 3)).backward()
        fresh.step()
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert len(fresh.state) == len(list(model.parameters()))
    for p in model.parameters():
        st = fresh.state[p]
        assert isinstance(st["step"], torch.Tensor) and st["step"].item() == 2
        for key in ("exp_avg", "exp_avg_sq"):
            every = hvd.allgather(st[key].unsqueeze(0))
            assert torch.equal(every, st[key].expand_as(every)) and st[key].abs().sum() > 0


def test_broadcast_optimizer_state_nested_lbfgs_and_wrapped(mode: str) -> None:
    model = mlp(1)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5 + R, history_size=3)

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = loss_fn(model(torch.ones(2, 5)), torch.zeros(2, 3))
        loss.backward()
        return loss

    if R == 0:  # nested state (lists of tensors, Python numbers) exists only on the root
        lbfgs.step(closure)
    hvd.broadcast_optimizer_state(lbfgs, root_rank=0)
    st = lbfgs.state[model[0].weight]
    assert lbfgs.param_groups[0]["lr"] == 0.5 and st["n_iter"] >= 1 and len(st["old_dirs"]) >= 1
    every = hvd.allgather(st["d"].unsqueeze(0))
    assert torch.equal(every, st["d"].expand_as(every))
    sums = [float(t.sum()) for t in st["old_dirs"]]
    assert hvd.allgather_object(sums) == [sums] * N
    wrapped = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1)),
                                       named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(wrapped, root_rank=N - 1)
    assert wrapped.param_groups[0]["lr"] == 0.01 * N


def test_join_with_uneven_data(mode: str) -> None:
    data = batches(N, B, seed=13)  # rank r trains on r + 1 batches, then joins
    ref = mlp(1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        active = [r for r in range(N) if s < r + 1]
        sum(loss_fn(ref(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]) for r in active).div(N).backward()
        ref_opt.step()
    model = mlp(1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for batch in data[:R + 1]:
        opt.zero_grad()
        x, y = mine(batch, B)
        loss_fn(model(x), y).backward()
        opt.step()
    last = hvd.join()
    assert last == N - 1, last
    if R == N - 1:
        close(flat(model), flat(ref), "join: the longest-running rank trained with zeros from joined ranks")
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    close(flat(model), flat(ref), "join: after broadcasting from the last rank")
