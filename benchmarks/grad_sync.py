"""Gradient synchronisation of real models' gradient shapes: hvdlite against raw MPI, gloo and Horovod.

Run:   mpiexec -n 2 python benchmarks/grad_sync.py [--out benchmarks/results/grad_sync.json]
Smoke: mpiexec -n 2 python benchmarks/grad_sync.py --scale 0.001 --reps 2 --warmup 1

For each model (ResNet-50: 161 tensors, 25.6M floats; BERT-base: 199 tensors, 109.5M floats) the methods
below run interleaved, one repetition of each per round, so that load from elsewhere hits all alike. Each
repetition starts with a barrier; its time is the slowest rank's; the figure is the median over rounds.
  (a) mpi_flat_*        raw mpi4py Allreduce of one flat buffer: out of place, in place, in place in chunks.
                        The fastest of these is the transport's limit and the denominator of every ratio.
  (b) mpi_per_tensor    raw mpi4py Allreduce (in place), one call per tensor.
  (c) gloo_*            torch.distributed gloo all_reduce, per tensor (async, then wait) and on one buffer.
  (d) hvdlite_async     hvd.allreduce_async_ on every tensor, then synchronize, as the optimizer does.
  (e) hvdlite_grouped   hvd.grouped_allreduce_ of all tensors.
  (g) hvdlite_optimizer hvdlite.torch.DistributedOptimizer's own sync: every parameter's real post-accumulate
                        hook is called in backward's order (gradients are already views of the buckets, as
                        from the second step on), then synchronize(): bucketed, in place, through the comm hook.
  (f) hvd_module_async  (d) through --hvd-module NAME (e.g. horovod.torch), on torch tensors when the
                        module's name contains "torch", else on numpy arrays.
  diagnostics:          hvdlite_optimizer_sum: (g) with Sum (no scaling pass); hvdlite_optimizer_predivide: (g)
                        with gradient_predivide_factor=size (Average's division before the sum). The sync taken
                        apart further (the transport driven as the engine drives it) is lab/grad_sync_parts.py.
Tensors are submitted in reverse order, as backpropagation produces them. hvdlite methods use Average
(as DistributedOptimizer does) unless --op sum. One JSON object per line: a machine line, then one line per
model and method with ms, algorithm bandwidth (bytes/s) and the ratio to (a); per model a ``kind: summary`` line
with the sync figures of record as paired ratios (round by round, see PAIRS): Average over Sum in
DistributedOptimizer, and Sum (and Average) over the raw 1 MiB-chunked allreduce.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import _common  # noqa: E402
import hvdlite as hvd  # noqa: E402

GROUPS = {"mpi_flat_out_of_place": "a", "mpi_flat_in_place": "a", "mpi_per_tensor": "b",
          "gloo_per_tensor": "c", "gloo_flat": "c", "hvdlite_async": "d", "hvdlite_grouped": "e",
          "hvd_module_async": "f", "hvdlite_optimizer": "g"}


def group_of(method: str) -> str:
    """A method's group; variants and probes are diagnostics (never the limit)."""
    return "a" if method.startswith("mpi_flat_chunked") else GROUPS.get(method, "diag")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,bert-base", help="comma-separated: resnet50, bert-base, "
                   "small-transformer")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--chunk-mb", default="1,2,4", help="chunk sizes (MiB) of the chunked in-place baseline")
    p.add_argument("--scale", type=float, default=1.0, help="shrink every tensor to this fraction (smoke runs)")
    p.add_argument("--op", choices=("average", "sum"), default="average", help="reduce op of hvdlite methods")
    p.add_argument("--methods", default="", help="comma-separated subset of methods (default: all)")
    p.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed gloo methods")
    p.add_argument("--hvd-module", default="", help="a Horovod-compatible module to measure as (f)")
    p.add_argument("--hvd-setting", action="append", default=[], metavar="KEY=VALUE",
                   help="hvdlite init() setting, e.g. cycle_time_ms=0.5 (repeatable)")
    p.add_argument("--timeline", default="", help="write hvdlite's timeline (rank 0) to this path")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    return p.parse_args(argv)


class Bench:
    """Buffers of one model's gradients, and one callable per method."""

    def __init__(self, args: argparse.Namespace, comm: Any, model: str) -> None:
        import torch
        from shapes import gradient_shapes, scaled_shapes
        self.args, self.comm, self.model = args, comm, model
        self.shapes = scaled_shapes(gradient_shapes(model), args.scale)
        # One allocation per gradient, like autograd's; numpy views share their memory.
        self.tensors = [torch.ones(s, dtype=torch.float32) for s in self.shapes]
        self.order = list(range(len(self.shapes)))[::-1]  # backprop produces the last layer's first
        self.arrays = [self.tensors[i].numpy() for i in self.order]
        self.torch_order = [self.tensors[i] for i in self.order]
        self.names = [f"{model}.grad.{i}" for i in self.order]
        self.elements = sum(math.prod(s) for s in self.shapes)
        self.nbytes = self.elements * 4
        self.flat_t = torch.ones(self.elements, dtype=torch.float32)
        self.flat = self.flat_t.numpy()
        self.flat_out = np.empty_like(self.flat)
        self.op = hvd.Average if args.op == "average" else hvd.Sum
        self.hvd_module: Any = None
        #: method -> (enter, leave), run untimed around each of its repetitions
        self.hooks: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
        self.module_inputs: list[Any] = []
        self.resets: list[Callable[[], Any]] = []

    def reset(self) -> None:
        """Bring values back to 1 so repeated in-place sums never overflow."""
        for t in self.tensors:
            t.fill_(1.0)
        self.flat.fill(1.0)
        for fn in self.resets:
            fn()

    def all_methods(self) -> dict[str, Callable[[], None]]:
        from mpi4py import MPI
        comm, flat = self.comm, self.flat
        out: dict[str, Callable[[], None]] = {
            "mpi_flat_out_of_place": lambda: comm.Allreduce(flat, self.flat_out, op=MPI.SUM),
            "mpi_flat_in_place": lambda: comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM),
        }
        for mb in [float(x) for x in self.args.chunk_mb.split(",") if x]:
            label = f"{mb:g}MB"
            out[f"mpi_flat_chunked_{label}"] = self._chunked(max(1, int(mb * 2 ** 20) // 4))
        out["mpi_per_tensor"] = self._mpi_per_tensor
        if not self.args.no_gloo:
            import torch.distributed as dist
            tensors, flat_t = self.torch_order, self.flat_t

            def gloo_per_tensor() -> None:
                for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
                    work.wait()
            out["gloo_per_tensor"] = gloo_per_tensor
            out["gloo_flat"] = lambda: dist.all_reduce(flat_t)
        out["hvdlite_async"] = lambda: self._hvd_async(hvd, self.arrays, self.op, "")
        out["hvdlite_optimizer"] = self._optimizer()
        out["hvdlite_optimizer_sum"] = self._optimizer("sum.", op=hvd.Sum)
        out["hvdlite_optimizer_predivide"] = self._optimizer("predivide.", gradient_predivide_factor=hvd.size())
        out["hvdlite_grouped"] = lambda: hvd.grouped_allreduce_(self.arrays, name=f"{self.model}.grouped",
                                                                op=self.op)
        if self.args.hvd_module:
            self.hvd_module = _common.load_hvd_module(self.args.hvd_module)
            use_torch = "torch" in self.args.hvd_module
            self.module_inputs = self.torch_order if use_torch else self.arrays
            out["hvd_module_async"] = lambda: self._hvd_async(
                self.hvd_module, self.module_inputs, self.hvd_module.Average, "module.")
            if not self.args.hvd_module.startswith("hvdlite"):  # another library (hvdlite's own frontends share
                # its runtime): up only for its own repetitions, since Horovod's idle thread polls
                self.hvd_module.shutdown()
                self.hooks["hvd_module_async"] = (self.hvd_module.init, self.hvd_module.shutdown)
        return out

    def methods(self) -> dict[str, Callable[[], None]]:
        """all_methods(), or those --methods names (the mpi_flat limits always)."""
        out = self.all_methods()
        if self.args.methods:
            wanted = [m for m in self.args.methods.split(",") if m]  # NAME, or PREFIX* for every match
            unknown = [m for m in wanted if m not in out and not (m.endswith("*") and
                                                                 any(n.startswith(m[:-1]) for n in out))]
            if unknown:
                raise SystemExit(f"unknown methods {unknown}; available: {', '.join(out)}")
            out = {m: out[m] for m in out if m in wanted or m.startswith("mpi_flat")
                   or any(m.startswith(w[:-1]) for w in wanted if w.endswith("*"))}
        return out

    def _chunked(self, step: int) -> Callable[[], None]:
        from mpi4py import MPI
        comm, flat = self.comm, self.flat
        pieces = [flat[i:i + step] for i in range(0, flat.size, step)]

        def run() -> None:
            for piece in pieces:
                comm.Allreduce(MPI.IN_PLACE, piece, op=MPI.SUM)
        return run

    def _mpi_per_tensor(self) -> None:
        from mpi4py import MPI
        for a in self.arrays:
            self.comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def _optimizer(self, prefix: str = "", **kwargs: Any) -> Callable[[], None]:
        """DistributedOptimizer over parameters of the model's shapes (SGD, lr 0: step() changes nothing),
        built with ``kwargs`` (op, gradient_predivide_factor) besides the parameters."""
        import torch
        import hvdlite.torch as hvd_torch
        params = [torch.nn.Parameter(torch.ones(s, dtype=torch.float32)) for s in self.shapes]
        opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                             named_parameters=[(f"{prefix}{self.model}.p{i}", p)
                                                               for i, p in enumerate(params)], **kwargs)
        ordered = [params[i] for i in self.order]
        hooks = [list(p._post_accumulate_grad_hooks.values()) for p in ordered]  # what autograd calls

        def sync() -> None:
            for p, fns in zip(ordered, hooks):
                for fn in fns:
                    fn(p)
            opt.synchronize()

        for p in params:
            p.grad = torch.ones_like(p)
        sync()  # the first step agrees on the layout; afterwards each gradient is a view of its bucket
        self.resets.append(lambda: [p.grad.fill_(1.0) for p in params])
        return sync

    def _hvd_async(self, module: Any, inputs: list[Any], op: Any, prefix: str) -> None:
        handles = [module.allreduce_async_(x, name=prefix + n, op=op) for x, n in zip(inputs, self.names)]
        for h in handles:
            module.synchronize(h)


def run_model(args: argparse.Namespace, comm: Any, model: str, output: _common.Output, kind: type = Bench) -> None:
    bench = kind(args, comm, model)
    methods = bench.methods()
    series = {name: _common.Series(name) for name in methods}
    hvd_stats = {name: [0, 0] for name in methods if name.startswith("hvdlite")}
    for rnd in range(args.warmup + args.reps):
        if rnd % 5 == 0:  # up to ~15 in-place sums of the flat buffer per round: 2**75 at most
            bench.reset()
        for name, fn in list(methods.items())[::1 if rnd % 2 else -1]:  # both orders: no place favoured
            before = hvd.engine_stats() if name in hvd_stats else None
            enter, leave = bench.hooks.get(name, (None, None))
            if enter is not None:
                enter()
            elapsed = _common.timed(comm, fn)
            if leave is not None:
                leave()
            if rnd >= args.warmup:
                series[name].times.append(elapsed)
                if before is not None:
                    after = hvd.engine_stats()
                    hvd_stats[name][0] += after["cycles"] - before["cycles"]
                    hvd_stats[name][1] += after["mpi_calls"] - before["mpi_calls"]
    results = {name: _common.summarize(comm, s) for name, s in series.items()}
    limit_method = min((n for n in results if group_of(n) == "a"), key=lambda n: results[n]["ms"])
    limit_ms = results[limit_method]["ms"]
    for name, res in results.items():
        record: dict[str, Any] = {
            "bench": "grad_sync", "model": model, "method": name, "group": group_of(name),
            "tensors": len(bench.shapes), "bytes": bench.nbytes, "ranks": comm.Get_size(), **res,
            "bytes_per_s": bench.nbytes / (res["ms"] / 1e3), "ratio": res["ms"] / limit_ms,
            "limit_method": limit_method}
        if name in hvd_stats and args.reps:
            record["engine_cycles_per_rep"] = hvd_stats[name][0] / args.reps
            record["mpi_calls_per_rep"] = hvd_stats[name][1] / args.reps
        if name == "hvd_module_async":
            record["module"] = args.hvd_module
        output.emit(record)
    summary: dict[str, Any] = {"bench": "grad_sync", "kind": "summary", "model": model}
    for label, num, den in PAIRS:
        if num in series and den in series:
            summary[label] = paired_ratio(comm, series[num].times, series[den].times)
    output.emit(summary)


#: The sync figures of record, each a ratio of two methods measured in the same rounds.
PAIRS = (("optimizer_average_over_sum", "hvdlite_optimizer", "hvdlite_optimizer_sum"),
         ("optimizer_sum_over_chunked_1MB", "hvdlite_optimizer_sum", "mpi_flat_chunked_1MB"),
         ("optimizer_average_over_chunked_1MB", "hvdlite_optimizer", "mpi_flat_chunked_1MB"))


def paired_ratio(comm: Any, num: list[float], den: list[float]) -> dict[str, float]:
    """The ratio of two methods round by round (each round's slowest rank; the two ran one after the other in
    that round, so load from elsewhere hits both alike): its median and the range, and the ratio of the bests."""
    from mpi4py import MPI
    worst = np.empty((2, len(num)), dtype=np.float64)
    comm.Allreduce(np.array([num, den], dtype=np.float64), worst, op=MPI.MAX)
    ratios = sorted(float(r) for r in worst[0] / worst[1])
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
            "best_over_best": float(worst[0].min() / worst[1].min()), "rounds": len(ratios)}


def main(argv: list[str] | None = None, kind: type = Bench) -> None:
    """The benchmark with ``kind``'s methods (a subclass of Bench adds its own)."""
    args = parse_args(argv)
    hvd.init(**_common.parse_settings(args.hvd_setting))
    from mpi4py import MPI
    import torch
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    if not args.no_gloo:
        _common.init_gloo(comm)
    output = _common.Output(comm.Get_rank(), args.out)
    st = hvd.core.Config.from_env(**_common.parse_settings(args.hvd_setting))  # what init() was given
    output.emit(_common.machine_info("grad_sync", comm.Get_size(), reps=args.reps, warmup=args.warmup,
                                     scale=args.scale, op=args.op, cycle_time_ms=st.cycle_time_ms,
                                     fusion_threshold_bytes=st.fusion_threshold_bytes,
                                     allreduce_chunk_bytes=st.allreduce_chunk_bytes))
    if args.timeline:
        hvd.start_timeline(args.timeline, mark_cycles=True)
    start = time.perf_counter()
    for model in [m for m in args.models.split(",") if m]:
        run_model(args, comm, model, output, kind)
    if args.timeline:
        hvd.stop_timeline()
    output.emit({"bench": "grad_sync", "kind": "done", "seconds": time.perf_counter() - start})
    output.close()
    if not args.no_gloo:
        import torch.distributed as dist
        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
