"""torch training throughput on synthetic data (like Horovod's synthetic benchmark): hvdlite against DDP and Horovod.

Run:   mpiexec -n 2 python benchmarks/train_throughput.py [--out benchmarks/results/train_throughput.json]
Smoke: mpiexec -n 2 python benchmarks/train_throughput.py --tiny

The methods run interleaved, a round of --steps steps each, so that load from elsewhere hits all alike:
  single       one process, no communication (rank 0 alone; the other ranks wait without spinning)
  independent  every rank trains its own copy at once, no communication: the machine's own limit
  hvdlite      hvdlite.torch DistributedOptimizer
  ddp          torch DistributedDataParallel over gloo (no buffer broadcast per step: like Horovod, only
               gradients are averaged)
  hvd_module   --hvd-module NAME's DistributedOptimizer (e.g. horovod.torch), if given
Models: a ResNet-50 on 64x64 images, and a small BERT-style transformer (4 layers, width 256, sequence 64). Each
rank uses --threads threads (default: cores // ranks), and so does the single-process baseline. Reported per
method: samples/s over all ranks (median round), scaling efficiency = throughput(N) / (N x throughput(1)),
of_machine = a method's throughput / independent's, and the ratios hvdlite / ddp and hvdlite / hvd_module.
lab/keras_throughput.py is the same measure for Keras.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,transformer", help="comma-separated: resnet50, transformer")
    p.add_argument("--batch", type=int, default=0, help="samples per rank per step (default: per model)")
    p.add_argument("--image-size", type=int, default=64, help="ResNet input resolution")
    p.add_argument("--seq-len", type=int, default=64, help="transformer sequence length")
    p.add_argument("--steps", type=int, default=3, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per method (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method first")
    p.add_argument("--threads", type=int, default=0, help="torch/TF threads per rank (default cores // ranks)")
    p.add_argument("--tiny", action="store_true", help="tiny models and sizes, for smoke tests")
    p.add_argument("--hvd-module", default="", help="a Horovod-compatible torch module to measure too")
    p.add_argument("--hvd-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="hvdlite init() setting, e.g. cycle_time_ms=0.5 (repeatable)")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    return p.parse_args(argv)


def default_threads(args: argparse.Namespace, ranks: int) -> int:
    return args.threads or max(1, (os.cpu_count() or 1) // ranks)


def default_batch(args: argparse.Namespace, model: str) -> int:
    return args.batch or (2 if args.tiny else 16)


# -- shared worker pieces ------------------------------------------------------------------------------
def wait_quietly(comm: Any) -> None:
    """Ranks other than 0 wait here (sleeping, not spinning) while rank 0 runs the single-process baseline."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def run_rounds(comm: Any, methods: dict[str, tuple], args: argparse.Namespace) -> dict[str, list[float]]:
    """Per method, the seconds of each timed round (slowest rank). ``(step, single[, enter, leave])``: single
    runs on rank 0; ``enter``/``leave`` run around each of the method's rounds, untimed (a Horovod-compatible
    module is initialised only for its own rounds: Horovod's idle background thread polls, which would
    slow the methods measured beside it)."""
    import numpy as np
    from mpi4py import MPI
    rank = comm.Get_rank()

    def run(step: Callable[[], Any], single: bool, steps: int) -> float:
        if single and rank != 0:
            wait_quietly(comm)
            return 0.0
        if not single:
            comm.Barrier()
        start = time.perf_counter()
        own = 0.0
        for _ in range(steps):
            measured = step()  # a step may time itself (Keras: first batch start to last batch end)
            own += measured if isinstance(measured, float) else 0.0
        elapsed = own or time.perf_counter() - start
        if single:
            comm.Ibarrier().Wait()  # releases the waiting ranks (a non-blocking barrier matches only those)
        return elapsed

    def around(method: tuple, steps: int) -> float:
        step, single, *hooks = method
        if hooks:
            hooks[0]()
        try:
            return run(step, single, steps)
        finally:
            if hooks:
                hooks[1]()

    for method in methods.values():
        around(method, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, method in methods.items():
            times[name].append(around(method, args.steps))
    out: dict[str, list[float]] = {}
    for name, values in times.items():
        local = np.asarray(values, dtype=np.float64)
        worst = np.empty_like(local)
        comm.Allreduce(local, worst, op=MPI.MAX)
        out[name] = worst.tolist()
    return out


def summarize(framework: str, model: str, batch: int, nranks: int, times: dict[str, list[float]],
              steps: int, single_methods: set[str], extra: dict[str, Any]) -> list[dict[str, Any]]:
    import statistics
    out: list[dict[str, Any]] = []
    throughput: dict[str, float] = {}
    for name, rounds in times.items():
        step_s = statistics.median(rounds) / steps
        ranks = 1 if name in single_methods else nranks
        throughput[name] = ranks * batch / step_s
        out.append({"bench": "train_throughput", "framework": framework, "model": model, "method": name,
                    "ranks": ranks, "batch_per_rank": batch, "step_ms": step_s * 1e3,
                    "step_ms_min": min(rounds) / steps * 1e3, "step_ms_max": max(rounds) / steps * 1e3,
                    "samples_per_s": throughput[name], **extra})
    single = throughput.get("single")
    for record in out:
        if single and record["method"] not in single_methods:
            record["scaling_efficiency"] = record["samples_per_s"] / (record["ranks"] * single)
        if "independent" in throughput and record["method"] not in single_methods | {"independent"}:
            record["of_machine"] = record["samples_per_s"] / throughput["independent"]
        if "ddp" in throughput and record["method"] in ("hvdlite", "hvd_module"):
            record["vs_ddp"] = record["samples_per_s"] / throughput["ddp"]
        if "hvd_module" in throughput and record["method"] == "hvdlite":
            record["vs_hvd_module"] = record["samples_per_s"] / throughput["hvd_module"]
    return out


# -- torch worker ------------------------------------------------------------------------------------
def torch_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    import hvdlite.torch as hvd
    from shapes import Bert, ResNet, small_transformer
    hvd.init(**_common.parse_settings(args.hvd_setting))
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = default_threads(args, size)
    torch.set_num_threads(threads)
    _common.init_gloo(comm)
    module = _common.load_hvd_module(args.hvd_module) if args.hvd_module else None
    output = _common.Output(rank, args.out)
    output.emit(_common.machine_info("train_throughput", size, framework="torch", threads_per_rank=threads,
                                     steps=args.steps, rounds=args.rounds, warmup=args.warmup,
                                     image_size=args.image_size, seq_len=args.seq_len, tiny=args.tiny))
    for model_name in [m for m in args.models.split(",") if m]:
        batch = default_batch(args, model_name)
        gen = torch.Generator().manual_seed(1234 + rank)
        if model_name == "resnet50":
            def build() -> torch.nn.Module:
                torch.manual_seed(0)
                return ResNet(blocks=(1, 1, 1, 1), base_width=8, num_classes=10) if args.tiny else \
                    ResNet(num_classes=10)
            res = 16 if args.tiny else args.image_size
            x = torch.randn(batch, 3, res, res, generator=gen)
        elif model_name == "transformer":
            def build() -> torch.nn.Module:
                torch.manual_seed(0)
                return Bert(vocab=500, hidden=32, layers=1, heads=2, intermediate=64, max_positions=16,
                            num_classes=10) if args.tiny else small_transformer(10)
            seq = 8 if args.tiny else args.seq_len
            x = torch.randint(0, 500 if args.tiny else 16000, (batch, seq), generator=gen)
        else:
            raise SystemExit(f"unknown model {model_name!r}")
        y = torch.randint(0, 10, (batch,), generator=gen)

        def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
            def step() -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            return step

        methods: dict[str, tuple[Callable[[], None], bool]] = {}
        single_model = build()
        single_step = make_step(single_model, torch.optim.SGD(single_model.parameters(), lr=0.01, momentum=0.9))
        methods["single"] = (single_step, True)
        methods["independent"] = (single_step, False)  # every rank at once: its copy diverges, timing only
        hvd_model = build()
        hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01, momentum=0.9),
                                           named_parameters=hvd_model.named_parameters())
        hvd.broadcast_parameters(hvd_model.state_dict(), root_rank=0)
        methods["hvdlite"] = (make_step(hvd_model, hvd_opt), False)
        ddp_model = torch.nn.parallel.DistributedDataParallel(build(), **ddp_no_buffer_sync())
        methods["ddp"] = (make_step(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01,
                                                                momentum=0.9)), False)
        if module is not None:
            separate = not args.hvd_module.startswith("hvdlite")  # another library: up only for its own rounds
            if separate and not module.is_initialized():
                module.init()
            mod_model = build()
            mod_opt = module.DistributedOptimizer(
                torch.optim.SGD(mod_model.parameters(), lr=0.01, momentum=0.9),
                named_parameters=[("hvdmod." + n, p) for n, p in mod_model.named_parameters()])
            module.broadcast_parameters(mod_model.state_dict(), root_rank=0)
            methods["hvd_module"] = (make_step(mod_model, mod_opt), False)
            if separate:
                module.shutdown()
                methods["hvd_module"] += (module.init, module.shutdown)
        times = run_rounds(comm, methods, args)
        params = sum(p.numel() for p in single_model.parameters())
        extra = {"parameters": params, "threads_per_rank": threads, "hvdlite_overlap": hvd_opt.overlap}
        if module is not None:
            extra["module"] = args.hvd_module
        for record in summarize("torch", model_name, batch, size, times, args.steps, {"single"}, extra):
            output.emit(record)
        del methods, single_model, hvd_model, hvd_opt, ddp_model
    output.emit({"bench": "train_throughput", "framework": "torch", "kind": "done"})
    output.close()
    dist.destroy_process_group()
    hvd.shutdown()


def ddp_no_buffer_sync() -> dict[str, bool]:
    """DDP's keyword for "do not broadcast buffers every forward" (renamed in newer torch)."""
    import inspect
    import torch
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def main(argv: list[str] | None = None) -> int:
    torch_worker(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
