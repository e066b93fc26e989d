"""Peak RSS per rank of a BERT-base training step: hvdlite (one or more checkouts) against DDP, Horovod, plain torch.

    python benchmarks/peak_rss.py --hvdlite-path . --hvdlite-path before=../bench-419 \\
        --out benchmarks/results/peak_rss.json                                  # ~4 min at 2 ranks, 2 repeats
    python benchmarks/peak_rss.py --horovod-venv /work/venv-hvd ...             # Horovod's too

Every configuration runs in fresh processes (``ru_maxrss`` only grows), ``--repeats`` times, in alternating
order: ``single`` (plain torch, one process: the floor), ``ddp`` (DistributedDataParallel over gloo at --np
ranks), ``hvdlite:LABEL`` (hvdlite.torch's DistributedOptimizer at --np ranks with hvdlite imported from the
checkout DIR of ``--hvdlite-path [LABEL=]DIR``; repeatable, the first is the one compared with the others) and,
with ``--horovod-venv``, ``horovod`` (horovod.torch with that venv's Python and mpiexec). Each takes --steps
training steps (AdamW, cross entropy, batch x seq token ids) of BERT-base (shapes.Bert; --model tiny for smoke
runs), clearing gradients with ``zero_grad()`` (torch's default set_to_none=True); ``--zero-grad none,zeros``
runs every configuration also with ``zero_grad(set_to_none=False)`` (names end in /zeros). Each rank writes its
peak RSS (ru_maxrss) and its RSS after building the model; the driver prints one line per run and a summary per
zero_grad mode: per configuration the median over repeats of the highest rank's peak, and the ratios of the
first hvdlite checkout to the others, to Horovod, to DDP and to the single-process floor.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def _rank_size() -> tuple[int, int]:
    """This process's rank and the job size from the launcher's environment (MPICH, Open MPI, Slurm), else 0/1."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


# -- worker: one rank of one configuration --------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.nn import functional as F
    from shapes import Bert  # beside this script; hvdlite comes from PYTHONPATH only

    rank, size = _rank_size()
    module: Any = None
    if args.worker == "module":
        module = importlib.import_module(args.module)
        module.init()
        rank, size = module.rank(), module.size()
    elif args.worker == "ddp":
        if not args.port:
            raise SystemExit("peak_rss.py --worker ddp needs --port (the driver picks one)")
        import datetime
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    torch.manual_seed(0)
    model = Bert(vocab=500, hidden=32, layers=1, heads=2, intermediate=64, max_positions=64, num_classes=2) \
        if args.model == "tiny" else Bert(num_classes=2)
    if args.worker == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    rss_model = _rss_mb()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if module is not None:
        opt = module.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        module.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, 500 if args.model == "tiny" else 30522, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, 2, (args.batch,), generator=gen)
    after_step = []
    began = time.perf_counter()
    if args.zero_grad == "none":
        clear = opt.zero_grad  # what training scripts call: torch's default set_to_none=True
    elif "set_to_none" in inspect.signature(opt.zero_grad).parameters:
        clear = functools.partial(opt.zero_grad, set_to_none=False)
    else:  # Horovod 0.28's zero_grad() takes no argument (it checks for pending handles, then calls torch's)
        clear = functools.partial(torch.optim.Optimizer.zero_grad, opt, set_to_none=False)
    for _ in range(args.steps):
        clear()
        F.cross_entropy(model(ids), labels).backward()
        opt.step()
        after_step.append(round(_rss_mb(), 1))
    record = {"bench": "peak_rss", "kind": "rank", "rank": rank, "ranks": size, "peak_rss_mb": round(_rss_mb(), 1),
              "rss_after_model_mb": round(rss_model, 1), "peak_after_step_mb": after_step,
              "step_s": round((time.perf_counter() - began) / args.steps, 3),
              "parameters": sum(p.numel() for p in model.parameters())}
    if module is not None:
        top = importlib.import_module(args.module.split(".")[0])
        record["module_file"] = top.__file__
        record["module_version"] = getattr(top, "__version__", "")
        if hasattr(opt, "overlap"):
            record["hvdlite_overlap"] = opt.overlap
    # A file per rank: lines that two ranks print at once through mpiexec can interleave.
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    if module is not None:
        module.shutdown()
    elif args.worker == "ddp":
        # the DDP reducer holds the group and its threads: it goes first (as in train_throughput.py), and both ranks
        # are done talking before the teardown (a group destroyed under a live reducer can abort at exit)
        del model, opt, clear
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------------------
def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What to run: name, Python, launcher, worker flags, PYTHONPATH and the directory hvdlite must come from."""
    py = sys.executable
    base = ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
            "--timeout", str(args.timeout)]
    out: list[dict[str, Any]] = []
    for mode in [m for m in args.zero_grad.split(",") if m]:
        if mode not in ("none", "zeros"):
            raise SystemExit(f"peak_rss.py: --zero-grad takes none and/or zeros, got {mode!r}")
        for config in _configurations(args, py, [*base, "--zero-grad", mode]):
            config["zero_grad"] = mode
            config["name"] += "" if mode == "none" else "/zeros"
            out.append(config)
    return out


def _configurations(args: argparse.Namespace, py: str, common: list[str]) -> list[dict[str, Any]]:
    from _common import git_commit, mpiexec_beside  # (the driver put benchmarks/ on the path)
    out: list[dict[str, Any]] = []
    if not args.no_single:
        out.append({"name": "single", "ranks": 1, "cmd": [py, str(HERE), "--worker", "single", *common],
                    "pythonpath": ""})
    if not args.no_ddp:
        out.append({"name": "ddp", "ranks": args.np, "cmd": [mpiexec_beside(py), "-n", str(args.np), py, str(HERE),
                                                             "--worker", "ddp", *common], "pythonpath": ""})
    labels: set[str] = set()
    for item in args.hvdlite_path or [str(ROOT)]:
        label, sep, directory = item.partition("=")
        path = Path(directory if sep else label).resolve()
        if not (path / "hvdlite" / "__init__.py").is_file():
            raise SystemExit(f"peak_rss.py: --hvdlite-path {item!r}: {path} has no hvdlite package")
        label = label if sep else git_commit(path)
        if label in labels:
            label = f"{label}@{path}"
        labels.add(label)
        out.append({"name": f"hvdlite:{label}", "ranks": args.np, "path": str(path), "commit": git_commit(path),
                    "cmd": [mpiexec_beside(py), "-n", str(args.np), py, str(HERE), "--worker", "module",
                            "--module", "hvdlite.torch", *common], "pythonpath": str(path)})
    if args.horovod_venv:
        hpy = str(Path(args.horovod_venv).resolve() / "bin" / "python")
        if not Path(hpy).is_file():
            raise SystemExit(f"peak_rss.py: --horovod-venv {args.horovod_venv}: no bin/python there")
        out.append({"name": "horovod", "ranks": args.np, "cmd": [mpiexec_beside(hpy), "-n", str(args.np), hpy,
                                                                 str(HERE), "--worker", "module", "--module",
                                                                 "horovod.torch", *common], "pythonpath": ""})
    return out


def run_one(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from _common import free_port
    cmd = list(config["cmd"])
    if "ddp" in cmd:
        cmd += ["--port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=config["pythonpath"])  # exactly that checkout's hvdlite, or none
    if not config["pythonpath"]:
        del env["PYTHONPATH"]
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config["ranks"])))
    with tempfile.TemporaryDirectory(prefix="peak_rss.") as folder:
        proc = subprocess.run(cmd + ["--result-dir", folder], capture_output=True, text=True, timeout=args.timeout,
                              env=env, cwd=str(HERE.parent))
        ranks_done = len(list(Path(folder).glob("rank*.json"))) == config["ranks"]
        torn_down = "ddp" in cmd and ranks_done and "terminate called without an active exception" in proc.stderr
        if proc.returncode != 0 and torn_down:
            # the peer's own teardown (torch's gloo threads at exit, seen about once in 20 DDP launches) aborted after
            # every rank had measured and written its figures: keep them, and say so in the record and on stderr
            print(f"peak_rss.py: {config['name']}: the DDP processes aborted at exit after measuring "
                  f"(exit {proc.returncode}); figures kept", file=sys.stderr)
        elif proc.returncode != 0:
            raise SystemExit(f"peak_rss.py: {config['name']}: {' '.join(cmd)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        ranks = sorted((json.loads(f.read_text(encoding="utf-8")) for f in Path(folder).glob("rank*.json")),
                       key=lambda r: r["rank"])
    if len(ranks) != config["ranks"]:
        raise SystemExit(f"peak_rss.py: {config['name']}: {len(ranks)} rank lines, expected {config['ranks']}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if "path" in config:  # hvdlite really came from the checkout named
        for r in ranks:
            if not Path(r["module_file"]).resolve().is_relative_to(Path(config["path"])):
                raise SystemExit(f"peak_rss.py: {config['name']} imported hvdlite from {r['module_file']}, "
                                 f"not from {config['path']}")
    record = {"bench": "peak_rss", "kind": "run", "config": config["name"], "ranks": config["ranks"],
              "zero_grad": config["zero_grad"], "teardown_abort": proc.returncode != 0,
              "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
              "rss_after_model_mb": max(r["rss_after_model_mb"] for r in ranks), "per_rank": ranks}
    for key in ("path", "commit"):
        if key in config:
            record[key] = config[key]
    return record


def summarize(configs: list[dict[str, Any]], runs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """One zero_grad mode's configurations: medians, and the first hvdlite checkout's ratios to the others."""
    configs = [c for c in configs if c["zero_grad"] == mode]
    suffix = "" if mode == "none" else "/zeros"
    rows: dict[str, dict[str, Any]] = {}
    for config in configs:
        mine = [r for r in runs if r["config"] == config["name"]]
        peaks = sorted(r["peak_rss_mb"] for r in mine)
        rows[config["name"]] = {"ranks": config["ranks"], "peak_rss_mb": round(statistics.median(peaks), 1),
                                "peak_rss_mb_min": peaks[0], "peak_rss_mb_max": peaks[-1], "repeats": len(peaks),
                                "rss_after_model_mb": round(statistics.median(r["rss_after_model_mb"]
                                                                              for r in mine), 1)}
    summary: dict[str, Any] = {"bench": "peak_rss", "kind": "summary", "zero_grad": mode, "configs": rows}
    hvd_names = [c["name"] for c in configs if c["name"].startswith("hvdlite:")]
    if hvd_names:
        first = rows[hvd_names[0]]["peak_rss_mb"]
        summary["subject"] = hvd_names[0]
        for other in [*hvd_names[1:], *(name + suffix for name in ("horovod", "ddp", "single"))]:
            if other in rows:
                key = other[:-len(suffix)] if suffix else other
                summary[f"over_{key}"] = round(first / rows[other]["peak_rss_mb"], 4)
                summary[f"minus_{key}_mb"] = round(first - rows[other]["peak_rss_mb"], 1)
    return summary


def driver(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE.parent))
    import _common
    configs = configurations(args)
    output = _common.Output(0, args.out)
    emit = output.emit
    emit(_common.machine_info("peak_rss", args.np, model=args.model, batch=args.batch, seq=args.seq,
                              steps=args.steps, repeats=args.repeats, optimizer="AdamW",
                              configs=[c["name"] for c in configs]))
    runs = []
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for config in order:
            record = run_one(config, args)
            record["repeat"] = repeat
            runs.append(record)
            emit(record)
    for mode in dict.fromkeys(c["zero_grad"] for c in configs):
        summary = summarize(configs, runs, mode)
        summary["loadavg_1min_end"] = round(os.getloadavg()[0], 2)
        emit(summary)
    output.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks of the distributed configurations")
    p.add_argument("--hvdlite-path", action="append", default=[], metavar="[LABEL=]DIR",
                   help="a checkout whose hvdlite to measure (repeatable; default this one; the first is compared "
                        "with the others); LABEL defaults to its git commit")
    p.add_argument("--horovod-venv", default="", help="a venv with horovod.torch: measure it too")
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--no-single", action="store_true")
    p.add_argument("--model", choices=("bert-base", "tiny"), default="bert-base")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="training steps per process (the first allocates state)")
    p.add_argument("--repeats", type=int, default=2, help="fresh runs per configuration, alternating order")
    p.add_argument("--zero-grad", default="none", help="how each step clears gradients: none (zero_grad(), torch's "
                   "default set_to_none=True), zeros (set_to_none=False), or both: none,zeros")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    p.add_argument("--out", default="")
    p.add_argument("--worker", choices=("single", "ddp", "module"), default="", help=argparse.SUPPRESS)
    p.add_argument("--module", default="hvdlite.torch", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
