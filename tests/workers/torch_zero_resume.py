"""Worker: ZeroRedundancyOptimizer checkpoints (consolidated on rank 0) and resumes at another job size.

``python torch_zero_resume.py MODE CKPT OUT`` under mpiexec; MODE is
- ``first``:  train steps 0-4, consolidate, rank 0 saves model + optimizer state to CKPT;
- ``resume``: every rank loads CKPT, keeps its shard, trains steps 5-9, rank 0 saves the parameters to OUT;
- ``full``:   train steps 0-9 without interruption, rank 0 saves the parameters to OUT.
The global batch is the same 12 rows at every job size; each rank trains on its slice of it.
Run by tests/test_torch_zero_resume.py.
"""
import sys

import torch

import hvdlite.torch as hvd

MODE, CKPT, OUT = sys.argv[1:4]
GLOBAL_BATCH, STEPS, HALF = 12, 10, 5
torch.set_default_dtype(torch.float64)
hvd.init()
R, N = hvd.rank(), hvd.size()
assert GLOBAL_BATCH % N == 0, N

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.05)
gen = torch.Generator().manual_seed(7)
X, Y = torch.randn(STEPS, GLOBAL_BATCH, 8, generator=gen), torch.randn(STEPS, GLOBAL_BATCH, 4, generator=gen)
part = slice(R * GLOBAL_BATCH // N, (R + 1) * GLOBAL_BATCH // N)

start, stop = {"first": (0, HALF), "resume": (HALF, STEPS), "full": (0, STEPS)}[MODE]
if MODE == "resume":
    checkpoint = torch.load(CKPT, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    assert checkpoint["step"] == start, checkpoint["step"]

for step in range(start, stop):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(X[step, part]), Y[step, part]).backward()
    opt.step()

held = sum(v.numel() for s in opt.optim.state.values() for k, v in s.items() if k != "step")
print(f"rank={R} size={N} state_elements={held}", flush=True)
if MODE == "first":
    opt.consolidate_state_dict(to=0)
    if R == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": stop}, CKPT)
elif R == 0:
    torch.save([p.detach() for p in model.parameters()], OUT)
hvd.shutdown()
