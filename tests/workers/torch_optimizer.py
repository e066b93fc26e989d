"""Worker: DistributedOptimizer equals single-process training; broadcast helpers, join, SyncBatchNorm.

Run by tests/test_torch_optimizer.py under ``mpiexec -n 2`` and ``-n 3``; prints "OK <check>" per group.
Every rank also runs the single-process reference locally, on the concatenation of all ranks' batches.
"""
import os
import sys
import time
import warnings

import torch
import torch.nn as nn

import hvdlite.torch as hvd

T0 = time.time()
hvd.init()
R, N = hvd.rank(), hvd.size()
B, STEPS = 4, 3
torch.set_default_dtype(torch.float64)


#: How DistributedOptimizer was told to reduce: "on" from backward hooks, "off" at step(), or "auto".
OVERLAP = os.environ.get("HVDLITE_GRADIENT_OVERLAP", "auto")


def ok(what):
    line = f"OK {what} rank={R} overlap={OVERLAP} t={time.time() - T0:.1f}\n"
    sys.stdout.write(line)  # one write: lines never interleave
    sys.stdout.flush()


_probe = hvd.DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
assert _probe.overlap is {"on": True, "off": False}.get(OVERLAP, _probe.overlap), (OVERLAP, _probe.overlap)
del _probe


def close(a, b, what, tol=1e-10):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"{what}: max difference {diff} > {tol}"


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical_everywhere(model, what):
    w = flat(model)
    every = hvd.allgather(w.unsqueeze(0))
    assert torch.equal(every, w.expand_as(every)), f"{what}: weights differ between ranks"


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def batches(steps, per_rank, seed=0):
    """Global batches: step s's batch is the concatenation of every rank's per_rank rows."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(N * per_rank, 5, generator=g), torch.randn(N * per_rank, 3, generator=g))
            for _ in range(steps)]


def mine(batch, per_rank, part=0, parts=1):
    """This rank's rows of a global batch (optionally one of `parts` micro-batches)."""
    x, y = batch
    lo = R * per_rank
    step = per_rank // parts
    return x[lo + part * step: lo + (part + 1) * step], y[lo + part * step: lo + (part + 1) * step]


loss_fn = nn.MSELoss()


def equivalence(name, make_opt, passes=1, clip=None, tol=1e-10, toggle_overlap=False, **dist_kwargs):
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
    close(flat(model), flat(mlp(1)), f"{name}: broadcast_parameters(state_dict)", 0)
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **dist_kwargs)
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
    close(flat(model), flat(ref), f"{name}: weights equal single-process training", tol)
    assert_identical_everywhere(model, name)
    return opt


sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
adam = lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95))
opt = equivalence("sgd momentum", sgd)
assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
equivalence("adam", adam)
equivalence("overlap toggled between steps", adam, toggle_overlap=True)
equivalence("adamw passes=2", lambda p: torch.optim.AdamW(p, lr=0.01), passes=2)
equivalence("sgd passes=2", sgd, passes=2)
equivalence("groups=2", sgd, groups=2)
equivalence("sum with predivide", lambda p: torch.optim.SGD(p, lr=0.1), gradient_predivide_factor=2.0)
equivalence("clipping", sgd, clip=0.05)
equivalence("fp16 compression", sgd, tol=2e-3, compression=hvd.Compression.fp16)
equivalence("bf16 compression", sgd, tol=2e-2, compression=hvd.Compression.bf16)
ok("equivalence with single-process training")

# -- the clipping warning, zero_grad misuse, too many passes, names ------------------------------------
model = mlp(1)
opt = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
x, y = mine(batches(1, B)[0], B)
loss_fn(model(x), y).backward()
try:
    opt.zero_grad()
    raise AssertionError("zero_grad between backward and step did not raise")
except AssertionError as exc:
    assert "zero_grad() was called after loss.backward()" in str(exc), exc
try:
    loss_fn(model(x), y).backward()
    raise AssertionError("a second backward with backward_passes_per_step=1 did not raise")
except AssertionError as exc:
    assert "backward_passes_per_step" in str(exc), exc
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
assert any("skip_synchronize" in str(w.message) for w in caught), caught
opt.zero_grad()
opt.set_backward_passes_per_step(2)
loss_fn(model(x), y).backward()  # the first of two passes: as in Horovod, zero_grad() still refuses
try:
    opt.zero_grad()
    raise AssertionError("zero_grad between an accumulating backward and step did not raise")
except AssertionError as exc:
    assert "zero_grad() was called after loss.backward()" in str(exc), exc
loss_fn(model(x), y).backward()
opt.step()
opt.zero_grad()
opt.set_backward_passes_per_step(1)
params = list(model.named_parameters())
for bad, text in (([params[0], params[0]] + params[1:], "Found duplicates: 0.weight"),
                  (params[1:], "were not named"), ([p for _, p in params], "tuples (name, parameter)")):
    try:
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=bad)
        raise AssertionError(f"bad named_parameters did not raise ({text})")
    except ValueError as exc:
        assert text in str(exc), exc
rewrapped = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
for _ in range(2):  # the first optimizer is still alive: only the newest one's hooks may reduce
    rewrapped.zero_grad()
    loss_fn(model(x), y).backward()
    rewrapped.step()
assert not opt._handles
assert_identical_everywhere(model, "re-wrapped model")
if N & (N - 1):  # DistributedOptimizer(op=Adasum) itself: tests/parallel/test_torch_adasum.py
    try:
        hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Adasum)
        raise AssertionError("DistributedOptimizer(op=Adasum) on a set that is not a power of two did not raise")
    except ValueError as exc:
        assert "power-of-two" in str(exc), exc
ok("misuse errors")


# -- unused parameters and requires_grad toggled between steps ----------------------------------------
class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.head, self.late = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(5, 3)
        self.late.requires_grad_(False)  # frozen at construction, unfrozen later

    def forward(self, x, use_b):
        h = self.b(x) if use_b else self.a(x)
        out = self.head(torch.tanh(h))
        return out + self.late(x) if self.late.weight.requires_grad else out


def branch_plan(step, r):
    return (step + r) % 2 == 1  # ranks disagree on which branch runs


def set_trainable(model, step):
    model.head.requires_grad_(step != 1)  # frozen in step 1 only
    model.late.requires_grad_(step >= 2)


data = batches(4, B, seed=5)
ref = Branches()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
model = Branches()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for step, batch in enumerate(data):
    set_trainable(ref, step)
    ref_opt.zero_grad()
    sum(loss_fn(ref(*[mine_r[0], branch_plan(step, r)]), mine_r[1])
        for r, mine_r in enumerate((batch[0][r * B:(r + 1) * B], batch[1][r * B:(r + 1) * B]) for r in range(N))
        ).div(N).backward()
    ref_opt.step()
    set_trainable(model, step)
    opt.zero_grad()
    x, y = mine(batch, B)
    loss_fn(model(x, branch_plan(step, R)), y).backward()
    opt.step()
close(flat(model), flat(ref), "unused and toggled parameters")
assert_identical_everywhere(model, "unused and toggled parameters")
ok("unused parameters and requires_grad toggles")


# -- sparse gradients ---------------------------------------------------------------------------------
class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.emb, self.out = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 1)

    def forward(self, idx):
        return self.out(self.emb(idx).mean(1))


g = torch.Generator().manual_seed(9)
tokens = [torch.randint(0, 20, (N * B, 3), generator=g) for _ in range(STEPS)]
targets = [torch.randn(N * B, 1, generator=g) for _ in range(STEPS)]
for as_dense in (False, True):
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
ok("sparse gradients")

# -- SyncBatchNorm ------------------------------------------------------------------------------------
torch.manual_seed(6)
ref = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3))
model = nn.Sequential(nn.Linear(5, 4), hvd.SyncBatchNorm(4), nn.Tanh(), nn.Linear(4, 3))
model.load_state_dict(ref.state_dict())
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
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
ok("SyncBatchNorm")

# -- broadcast_parameters forms and broadcast_optimizer_state -----------------------------------------
bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
torch.manual_seed(20 + R)
for p in bn.parameters():
    p.data.normal_()
bn[1].running_mean.fill_(R)
bn[1].num_batches_tracked.fill_(7 + R)
extra = {"scalar": 1.5 * (R + 1), "w": torch.full((2,), float(R))}
hvd.broadcast_parameters(bn.state_dict(), root_rank=N - 1)
hvd.broadcast_parameters(extra, root_rank=N - 1)
assert bn[1].num_batches_tracked.item() == 7 + N - 1 and torch.equal(bn[1].running_mean, torch.full((3,), N - 1.0))
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

model = mlp(1)
fresh = torch.optim.Adam(model.parameters(), lr=0.001 * (R + 1), betas=(0.5 + 0.1 * R, 0.99))
hvd.broadcast_optimizer_state(fresh, root_rank=0)
assert fresh.param_groups[0]["lr"] == 0.001 and fresh.param_groups[0]["betas"] == (0.5, 0.99)
assert isinstance(fresh.param_groups[0]["betas"], tuple) and len(fresh.state) == 0
if R == 0:  # the root steps alone: its state now exists lazily, the others' does not
    loss_fn(model(torch.ones(2, 5)), torch.zeros(2, 3)).backward()
    fresh.step()
hvd.broadcast_optimizer_state(fresh, root_rank=0)
assert len(fresh.state) == len(list(model.parameters()))
for p in model.parameters():
    st = fresh.state[p]
    assert isinstance(st["step"], torch.Tensor) and st["step"].item() == 1
    for key in ("exp_avg", "exp_avg_sq"):
        every = hvd.allgather(st[key].unsqueeze(0))
        assert torch.equal(every, st[key].expand_as(every)) and st[key].abs().sum() > 0
lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5 + R, history_size=3)


def closure():
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
assert hvd.allgather_object([float(t.sum()) for t in st["old_dirs"]]) == [[float(t.sum()) for t in st["old_dirs"]]] * N
wrapped = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1)),
                                   named_parameters=model.named_parameters())
hvd.broadcast_optimizer_state(wrapped, root_rank=N - 1)
assert wrapped.param_groups[0]["lr"] == 0.01 * N
ok("broadcast_parameters and broadcast_optimizer_state")

# -- join with uneven data ----------------------------------------------------------------------------
data = batches(N, B, seed=13)  # rank r trains on r + 1 batches, then joins
ref = mlp(1)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for s, (x, y) in enumerate(data):
    ref_opt.zero_grad()
    active = [r for r in range(N) if s < r + 1]
    sum(loss_fn(ref(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]) for r in active).div(N).backward()
    ref_opt.step()
model = mlp(1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
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
ok("join with uneven data")
hvd.shutdown()
sys.stdout.write(f"DONE rank={R}\n")
sys.stdout.flush()
