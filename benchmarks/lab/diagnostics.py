"""Cost of issue 25's diagnostics: straggler attribution (on vs off) and deterministic reductions (vs the
default) on 1,000 small ops and on ResNet-50's gradient sync, the call-site check on the submit path, and
hvd.check_replicas on ResNet-50 vs a training step.

Run:   mpiexec -n 2 python benchmarks/lab/diagnostics.py [--out benchmarks/results/diagnostics.json]
Smoke: mpiexec -n 2 python benchmarks/lab/diagnostics.py --reps 2 --sessions 1 --inflight 50 --scale 0.01 --batch 1 \
           --image 64

Methods (one JSON line each, after a machine line; times are the slowest rank's, medians over repetitions):
  small_ops_<setting>          --inflight named 4-float ``allreduce_async`` (numpy, Sum), then synchronize each.
  grad_sync_<setting>          ResNet-50's 161 gradient tensors (``--scale`` of their size), one named in-place
                               ``allreduce_async_`` each (Average), then synchronize all.
     settings: ``default`` (straggler attribution on, window 1000), ``stragglers_off`` (window 0; the default's
     ``straggler_overhead`` is default / stragglers_off) and ``deterministic`` (``deterministic_cost`` is
     deterministic / default).
  callsite_check               ``callsite_capture``: the capture when a name is first submitted (a stack 8 frames
                               deep), in us; a known name's submission adds nothing (the line is its memo's).
  straggler_bookkeeping        the engine thread's straggler work measured on its own (min of repeats, so a loaded
                               machine disturbs it little): ``record_us_per_op`` per agreed op, ``adopt_ms`` per
                               window of 1000 ops, ``share_of_small_op`` against small_ops_stragglers_off.
  straggler_cpu_<what>         CPU time, not wall time (robust to the machine's load), of the engine thread (its
                               pthread CPU clock) and of the submitting thread (time.thread_time) per op, in
                               alternating sessions with straggler attribution on (default) and off (window 0):
                               ``engine_us_per_op_on/off``, ``submit_us_per_op_on/off`` (medians over repetitions,
                               the slowest rank's), ``full_rounds_per_op_on/off`` (mean); then one instrumented session
                               (on) that times the straggler code itself on the engine thread: ``record_us_per_op``,
                               ``keep_times_us_per_op`` (keeping each request's submission time at its cache bit
                               when it is counted, measured on its own: fresh requests, kept vs not),
                               ``window_us_per_op`` (each exchange: the all-gather, its wait and keeping the times,
                               then rank 0's analysis for its log line, per op), ``swap_wait_us_per_op`` (0: the
                               wait is inside the exchange since session 8; an older version polled for its end in
                               the next cycle), ``full_round_us`` (a full
                               negotiation round without the straggler code), and ``attributed_us_per_op``
                               (record + keep_times + window + any extra full rounds per op) with
                               ``attributed_share`` of the off setting's CPU per op (engine + submitter): the
                               feature's cost.
  resnet50_train_step          one ResNet-50 training step (--batch images of --image pixels, SGD with momentum,
                               DistributedOptimizer); ``check_replicas_module`` / ``check_replicas_optimizer``
                               the check of the model (parameters and buffers) and of the optimizer (parameters
                               and momentum), with ``ratio_to_step``.
``--parts cpu`` runs only the straggler_cpu methods (``wall``: only the whole-op wall times and the rest).
Sessions alternate the settings (hvdlite re-initialised each time), so all see the same machine state.
"""
from __future__ import annotations

import argparse
import sys
import time
import timeit
from typing import Any, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _common  # noqa: E402
import shapes  # noqa: E402
import hvdlite as hvd  # noqa: E402
import hvdlite.torch as hvd_torch  # noqa: E402


#: the CPU sessions' names (1,000 small + 161 gradients) all fit the response cache, so no round is a miss
CPU_SETTINGS = {"cache_capacity": 2048}
SETTINGS = {"default": {}, "stragglers_off": {"straggler_window_ops": 0}, "deterministic": {"deterministic": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inflight", type=int, default=1000, help="small allreduces per repetition")
    p.add_argument("--reps", type=int, default=7, help="repetitions per session and method")
    p.add_argument("--sessions", type=int, default=3, help="sessions per straggler setting (alternating)")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of ResNet-50's gradient sizes")
    p.add_argument("--batch", type=int, default=8, help="images per rank in the training step")
    p.add_argument("--image", type=int, default=224, help="image side in pixels")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--parts", default="wall,cpu", help="comma-separated: wall (timings, call site, replicas), "
                                                      "cpu (straggler CPU time per op)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from mpi4py import MPI
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    out = _common.Output(comm.Get_rank(), args.out)
    out.emit(_common.machine_info("diagnostics", comm.Get_size(), note="taken while other work loads the machine"))
    series = {f"{what}_{setting}": _common.Series(f"{what}_{setting}") for what in ("small_ops", "grad_sync")
              for setting in SETTINGS}
    small = [np.ones(4, np.float32) for _ in range(args.inflight)]
    grads = [np.ones(s, np.float32) for s in shapes.scaled_shapes(shapes.gradient_shapes("resnet50"), args.scale)]

    def small_ops() -> None:
        handles = [hvd.allreduce_async(a, name=f"s{i}", op=hvd.Sum) for i, a in enumerate(small)]
        for h in handles:
            hvd.synchronize(h)

    def grad_sync() -> None:
        handles = [hvd.allreduce_async_(g, name=f"g{i}", op=hvd.Average) for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)

    parts = set(args.parts.split(","))
    if "cpu" in parts:
        for record in straggler_cpu(comm, args, {"small_ops": (small_ops, len(small)),
                                                 "grad_sync": (grad_sync, len(grads))}):
            out.emit({"bench": "diagnostics", **record})
    if "wall" in parts:
        wall(comm, args, out, series, small_ops, grad_sync)
    out.close()


def wall(comm: object, args: argparse.Namespace, out: _common.Output, series: dict,
         small_ops: Callable[[], None], grad_sync: Callable[[], None]) -> None:
    """The whole-op wall times per setting, then the call site, straggler bookkeeping and check_replicas."""
    for _ in range(args.sessions):
        for setting, settings in SETTINGS.items():
            hvd.init(**settings)
            small_ops(), grad_sync()  # warm the response cache
            for _ in range(args.reps):
                series[f"small_ops_{setting}"].times.append(_common.timed(comm, small_ops))
                series[f"grad_sync_{setting}"].times.append(_common.timed(comm, grad_sync))
            hvd.shutdown()
    results = {name: _common.summarize(comm, s) for name, s in series.items()}
    for what in ("small_ops", "grad_sync"):
        default = results[f"{what}_default"]["ms"]
        out.emit({"bench": "diagnostics", "method": f"{what}_stragglers_off", **results[f"{what}_stragglers_off"]})
        out.emit({"bench": "diagnostics", "method": f"{what}_default", **results[f"{what}_default"],
                  "straggler_overhead": default / results[f"{what}_stragglers_off"]["ms"]})
        out.emit({"bench": "diagnostics", "method": f"{what}_deterministic", **results[f"{what}_deterministic"],
                  "deterministic_cost": results[f"{what}_deterministic"]["ms"] / default})

    hvd.init()
    small_ops()  # --inflight cached names, whose responses straggler_costs records
    out.emit({"bench": "diagnostics", "method": "callsite_check", **callsite_costs(
        results["small_ops_default"]["ms"] * 1e3 / args.inflight)})
    out.emit({"bench": "diagnostics", "method": "straggler_bookkeeping", **straggler_costs(
        comm.Get_size(), results["small_ops_stragglers_off"]["ms"] * 1e3 / args.inflight)})
    out.emit({"bench": "diagnostics", "method": "resnet50_train_step", **replica_costs(comm, args)})
    hvd.shutdown()


def straggler_cpu(comm: Any, args: argparse.Namespace,
                  workloads: dict[str, tuple[Callable[[], None], int]]) -> list[dict]:
    """CPU time per op of the engine and submitting threads with straggler attribution on vs off (alternating
    sessions), then the straggler code's own CPU time on the engine thread (one instrumented session)."""
    from hvdlite.core.runtime import state
    cpu: dict[str, list[float]] = {}
    for _ in range(args.sessions):
        for setting, settings in (("on", CPU_SETTINGS), ("off", {**CPU_SETTINGS, "straggler_window_ops": 0})):
            hvd.init(**settings)
            engine = state().engine
            thread = engine._thread
            for fn, _ in workloads.values():
                fn()  # warm the response cache
            for _ in range(args.reps):
                for what, (fn, ops) in workloads.items():
                    comm.Barrier()
                    e0, s0, f0 = thread_cpu_s(thread), time.thread_time(), engine.full_cycles
                    fn()
                    e1, s1, f1 = thread_cpu_s(thread), time.thread_time(), engine.full_cycles
                    for key, value in (("engine_us_per_op", (e1 - e0) * 1e6 / ops),
                                       ("submit_us_per_op", (s1 - s0) * 1e6 / ops),
                                       ("full_rounds_per_op", (f1 - f0) / ops)):
                        cpu.setdefault(f"{what}|{key}_{setting}", []).append(value)
            comm.Barrier()  # a rank's shutdown stops every engine: not while another still reads its clock
            hvd.shutdown()
    spent = _instrumented(comm, args, workloads)
    keep_times = keep_times_us_per_op()
    records = []
    for what, (_, ops) in workloads.items():
        rec: dict[str, Any] = {"method": f"straggler_cpu_{what}", "ops": ops, "reps": args.reps * args.sessions}
        for key in sorted(k.split("|")[1] for k in cpu if k.startswith(what + "|")):
            mine = cpu[f"{what}|{key}"]
            middle = float(np.mean(mine) if key.startswith("full_rounds") else np.median(mine))  # rounds: mean
            for stat, value in (("", middle), ("_min", min(mine))):
                rec[key + stat] = max(comm.allgather(value))  # the slowest rank's
        rec.update({k: max(comm.allgather(v)) for k, v in spent[what].items()})
        extra_rounds = max(rec["full_rounds_per_op_on"] - rec["full_rounds_per_op_off"], 0.0)
        rec["keep_times_us_per_op"] = max(comm.allgather(keep_times))
        rec["attributed_us_per_op"] = (rec["record_us_per_op"] + rec["keep_times_us_per_op"] + rec["window_us_per_op"]
                                       + extra_rounds * rec["full_round_us"])  # min: least waiting
        rec["attributed_share"] = rec["attributed_us_per_op"] / (rec["engine_us_per_op_off"]
                                                                 + rec["submit_us_per_op_off"])
        records.append(rec)
    return records


def keep_times_us_per_op(ops: int = 1000, reps: int = 200) -> float:
    """What counting a request's cache bit adds when it also keeps the request's submission time there
    (PendingBits with keep_times, the source of a cached round's times): CPU per op, ``ops`` fresh requests,
    on and off alternated, the difference of the medians (the instrumented record() does not see it)."""
    from hvdlite.core.engine.cache import PendingBits, ResponseCache
    from hvdlite.core.engine.requests import Kind, make_signature
    from hvdlite.core.reduce_ops import Sum
    cache = ResponseCache(ops, 0)
    sig = make_signature(Kind.ALLREDUCE, 0, Sum, 1.0, 1.0, -1, (("float32", (4,)),))
    names = [f"keep.{i}" for i in range(ops)]
    for name in names:
        cache.put(name, sig, [0], 0)
    bits = {keep: PendingBits(cache, keep_times=keep) for keep in (False, True)}
    spent: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for keep, pending_bits in bits.items():
            reqs = [_Request(name, sig) for name in names]  # fresh, as a step's requests are
            pending_bits.add([], {})
            t0 = time.thread_time()
            pending_bits.add(reqs, {})
            spent[keep].append(time.thread_time() - t0)
            for req in reqs:
                pending_bits.remove(req)
    return max(float(np.median(spent[True]) - np.median(spent[False])), 0.0) * 1e6 / ops


class _Request:
    """What PendingBits reads and writes of a request."""
    __slots__ = ("name", "sig", "key", "submitted", "cache_bit", "cache_version")

    def __init__(self, name: str, sig: Any) -> None:
        self.name, self.sig, self.key, self.submitted = name, sig, (sig.ps_id, name), time.monotonic()


def thread_cpu_s(thread: Any) -> float:
    """CPU seconds another (live) thread of this process has used: its pthread CPU clock."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _instrumented(comm: Any, args: argparse.Namespace,
                  workloads: dict[str, tuple[Callable[[], None], int]]) -> dict[str, dict[str, float]]:
    """One session with attribution on whose engine times (thread CPU) its straggler calls and full rounds."""
    from hvdlite.core.runtime import state
    hvd.init(**CPU_SETTINGS)
    engine = state().engine
    tracker = engine.observer.stragglers
    # this version's straggler calls (swap exchanges and adopts, settle analyses on rank 0; an older one had
    # wants_round/outgoing and adopted in the full round, then one swapped in one cycle and adopted in the next)
    methods = [n for n in ("record", "wants_round", "swap", "settle", "outgoing") if hasattr(tracker, n)]
    spent = dict.fromkeys([*methods, "full_round"], 0.0)
    calls = dict.fromkeys(spent, 0)
    rounds: list[float] = []  # each full round's CPU without the straggler calls inside it

    def inside() -> float:
        return sum(spent[n] for n in methods)

    def timing(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*a: Any, **kw: Any) -> Any:
            t0, before = time.thread_time(), inside()
            try:
                return method(*a, **kw)
            finally:
                took = time.thread_time() - t0
                spent[name] += took
                calls[name] += 1
                if name == "full_round":
                    rounds.append(took - (inside() - before))
        return timed_call
    for name in methods:
        setattr(tracker, name, timing(name, getattr(tracker, name)))
    from hvdlite.core.engine import negotiation as engine_rounds  # the rounds beyond the bit vector: votes, explaining
    for round_kind in ("vote_round", "explaining_round"):
        setattr(engine_rounds, round_kind, timing("full_round", getattr(engine_rounds, round_kind)))
    probe = timing("probe", lambda: None)
    spent["probe"], calls["probe"] = 0.0, 0
    for _ in range(20_000):
        probe()
    overhead = spent["probe"] / calls["probe"]  # what timing one call adds to it (two thread_time calls)
    result = {}
    for what, (fn, ops) in workloads.items():
        fn()
        for key in spent:
            spent[key], calls[key] = 0.0, 0
        rounds.clear()
        total = 0
        comm.Barrier()
        for _ in range(max(args.reps, -(-2000 // ops))):  # at least two windows of 1,000 ops
            fn()
            total += ops

        def net(*names: str) -> float:
            return max(sum(spent[n] - calls[n] * overhead for n in names if n in spent), 0.0)
        result[what] = {"record_us_per_op": net("record", "wants_round") * 1e6 / total,
                        "window_us_per_op": net("swap", "settle", "outgoing") * 1e6 / total,
                        "swap_wait_us_per_op": 0.0,
                        "record_calls_per_op": calls["record"] / total, "timing_overhead_us": overhead * 1e6,
                        "full_round_us": min(rounds, default=0.0) * 1e6,
                        "full_round_us_median": float(np.median(rounds)) * 1e6 if rounds else 0.0,
                        "instrumented_ops": total}
        comm.Barrier()
    hvd.shutdown()
    return result


def callsite_costs(small_op_us: float) -> dict:
    """A capture, which a name's first submission makes (a known name's reuses its memo's line)."""
    from hvdlite.core.engine import callsite

    def deep(k: int) -> object:
        return callsite.capture(1) if k == 0 else deep(k - 1)
    capture_us = min(timeit.repeat(lambda: deep(8), number=20_000, repeat=5)) / 20_000 * 1e6
    return {"callsite_capture_us": capture_us, "small_op_us": small_op_us}


def straggler_costs(size: int, small_op_us: float) -> dict:
    """Stragglers.record for 1000 agreed cached ops, and adopt() of a window from every rank."""
    from types import SimpleNamespace
    from hvdlite.core.config import Config
    from hvdlite.core.engine.stragglers import Stragglers
    from hvdlite.core.engine.timeline import Timeline
    from hvdlite.core.runtime import state
    cache = state().engine.cache
    responses = [r for r in cache.responses if r is not None][:1000]
    pending = {r.key: SimpleNamespace(submitted=0.0) for r in responses}
    tracker, timeline = Stragglers(Config(), 0, size), Timeline()

    def record() -> None:
        tracker.record(responses, pending, 1.0, timeline)  # a full round's path (a cached round's is per cycle)
        del tracker._submitted[:], tracker._agreed[:]
    record_us = min(timeit.repeat(record, number=20, repeat=5)) / 20 / len(responses) * 1e6
    window = np.stack([np.random.default_rng(r).random((2, 1000)) for r in range(size)])

    def adopt_and_report() -> None:
        tracker.adopt(window)
        tracker.settle(timeline)  # rank 0's analysis for its log line
        tracker.report()
    adopt_ms = min(timeit.repeat(adopt_and_report, number=5, repeat=3)) / 5 * 1e3
    return {"record_us_per_op": record_us, "adopt_ms": adopt_ms, "ops": len(responses),
            "small_op_us": small_op_us, "share_of_small_op": (record_us + adopt_ms * 1e3 / 1000) / small_op_us}


def replica_costs(comm: object, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = shapes.MODELS["resnet50"]()
    opt = hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())
    x = torch.randn(args.batch, 3, args.image, args.image)
    y = torch.randint(0, 1000, (args.batch,))
    model.eval()  # equal BatchNorm buffers on every rank, so the check passes and is timed in full

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    step()
    steps, modules, optimizers = (_common.Series(n) for n in ("step", "module", "optimizer"))
    for _ in range(max(3, args.reps // 2)):
        steps.times.append(_common.timed(comm, step))
        modules.times.append(_common.timed(comm, lambda: hvd_torch.check_replicas(model)))
        optimizers.times.append(_common.timed(comm, lambda: hvd_torch.check_replicas(opt)))
    s, m, o = (_common.summarize(comm, x) for x in (steps, modules, optimizers))
    return {**s, "batch": args.batch, "image": args.image, "check_replicas_module_ms": m["ms"],
            "check_replicas_optimizer_ms": o["ms"], "module_ratio_to_step": m["ms"] / s["ms"],
            "optimizer_ratio_to_step": o["ms"] / s["ms"], "tensors_module": len(model.state_dict())}


if __name__ == "__main__":
    main()
