"""Single-GPU overhead of hvdlite: a ResNet-50 training step (plain-torch model, benchmarks/shapes.py) with
hvd.DistributedOptimizer at -n 1 against the same step with plain torch, alternating rounds in one process.
At -n 1 DistributedOptimizer reduces nothing (as Horovod's); "hvdlite_forced" adds what a multi-GPU step pays
on top: every gradient through hvd.grouped_allreduce_ (Average) on the device data plane before step().

    mpiexec -n 1 python benchmarks/lab/gpu_overhead.py [--batch 64] [--image-size 224] [--rounds 5] [--steps 20]

Prints one JSON line: median step times and hvdlite's overhead in percent (goal <= 2 %). Without CUDA it
runs a tiny ResNet on CPU (a smoke test of the script, not a figure).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shapes import ResNet  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    hvd.init()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda" if cuda else "cpu")
    size, batch = (args.image_size, args.batch) if cuda else (32, 4)
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        return (ResNet(num_classes=1000) if cuda else ResNet(blocks=(1, 1, 1, 1), base_width=8,
                                                             num_classes=10)).to(dev)

    x = torch.randn(batch, 3, size, size, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    plain = build()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    model = build()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()

    def timed(m: torch.nn.Module, o: torch.optim.Optimizer, steps: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(m, o)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    timed(plain, plain_opt, 5)
    timed(model, opt, 5)
    forced = build()
    forced_opt = torch.optim.SGD(forced.parameters(), lr=0.01, momentum=0.9)

    class Forced:
        """A step that reduces every gradient through hvdlite (one grouped op) although there is one rank."""

        def zero_grad(self, set_to_none: bool = True) -> None:
            forced_opt.zero_grad(set_to_none=set_to_none)

        def step(self) -> None:
            hvd.grouped_allreduce_([p.grad for p in forced.parameters()], name="grads")
            forced_opt.step()

    timed(forced, Forced(), 5)  # type: ignore[arg-type]
    times: dict[str, list[float]] = {"torch": [], "hvdlite": [], "hvdlite_forced": []}
    steps = args.steps if cuda else 2
    for _ in range(args.rounds):  # alternate, so drifts (clocks, other load) hit both alike
        times["torch"].append(timed(plain, plain_opt, steps))
        times["hvdlite"].append(timed(model, opt, steps))
        times["hvdlite_forced"].append(timed(forced, Forced(), steps))  # type: ignore[arg-type]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "gpu_overhead", "device": torch.cuda.get_device_name() if cuda else "cpu (smoke test)",
        "ranks": hvd.size(), "batch": batch, "image_size": size, "steps_per_round": steps, "rounds": args.rounds,
        "torch_step_ms": round(med["torch"] * 1e3, 3), "hvdlite_step_ms": round(med["hvdlite"] * 1e3, 3),
        "overhead_percent": round(100 * (med["hvdlite"] / med["torch"] - 1), 2),
        "forced_step_ms": round(med["hvdlite_forced"] * 1e3, 3),
        "forced_overhead_percent": round(100 * (med["hvdlite_forced"] / med["torch"] - 1), 2),
        "rounds_ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
        "torch": torch.__version__}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
