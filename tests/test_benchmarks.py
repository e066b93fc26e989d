"""Smoke runs of the benchmarks of benchmarks/registry.py through ``python -m benchmarks --smoke``, and of the
cheap scripts of benchmarks/lab/ directly, with tiny sizes: well-formed JSON with every method, whatever each
script promises. Every script of benchmarks/ is in the registry, and every one of benchmarks/lab/ is named in one
line of its README.

Benchmarks are not tests: nothing here looks at a timing, only that each benchmark still runs and reports.
"""
from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import ROOT, json_lines, run_mpi

sys.path.insert(0, str(ROOT))
from benchmarks.registry import BENCHMARKS, BY_NAME, SUITES  # noqa: E402

BENCH = ROOT / "benchmarks"
LAB = BENCH / "lab"
Records = Any  # list[dict] of JSON lines, or one JSON object (negotiation_scale's)
#: files of benchmarks/ that are no benchmark of the registry themselves (helpers, the tables, the runner)
HELPERS = frozenset({"__init__", "__main__", "_common", "registry", "shapes", "tables"})
#: the lab scripts smoked here (the cheap ones): ranks of mpiexec (None: the script starts its own jobs), arguments
LAB_SMOKE: dict[str, tuple[Any, tuple[str, ...]]] = {
    "latency_breakdown": (2, ("--ops", "20")),
    "peer_wait": (2, ("--work", "20000", "--rounds", "1", "--hvd-module", "hvdlite.torch")),
    "gloo_vs_mpi": (2, ("--scale", "0.001", "--reps", "1", "--rounds", "1")),
    "powersgd_bytes": (2, ("--model", "small-transformer", "--steps", "1", "--ranks", "1,2")),
    "zero_throughput": (2, ("--rounds", "1", "--steps", "1", "--warmup", "0", "--batch-size", "2", "--seq", "8")),
    "negotiation_scale": (None, ("--sizes", "2", "--tensors", "2", "--steps", "3")),
    "profile_step": (2, ("--model", "transformer", "--batch", "2", "--rounds", "1")),
    "hw_scaling": (2, ("--tiny", "--steps", "1", "--rounds", "1")),
    "keras_throughput": (2, ("--tiny", "--steps", "2", "--rounds", "1", "--warmup", "1", "--models", "transformer")),
    "gpu_overhead": (1, ("--rounds", "1")),
    "zero_memory": (None, ("--ranks", "1,2", "--scale", "0.001", "--steps", "1", "--timeout", "240")),
}


def by_method(records: list[dict], **match: object) -> dict[str, dict]:
    return {r["method"]: r for r in records if "method" in r and all(r.get(k) == v for k, v in match.items())}


def assert_positive(record: dict, *keys: str) -> None:
    for key in keys:
        value = record[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, record)


def entry_point(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, \
        f"python -m benchmarks {' '.join(args)}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def smoke(name: str, tmp_path: Path, *extra: str, runner: tuple[str, ...] = ()) -> Records:
    """``python -m benchmarks --only NAME --smoke [RUNNER] [-- EXTRA]``: its results file (what the script printed),
    parsed."""
    proc = entry_point("--only", name, "--smoke", "--no-tables", "--results", str(tmp_path), *runner,
                       *(("--", *extra) if extra else ()))
    records = json_lines((tmp_path / f"{name}.json").read_text())
    assert json_lines(proc.stdout) == records
    return records


def lab_smoke(name: str) -> Records:
    """A lab script's smoke run (LAB_SMOKE), its stdout parsed."""
    ranks, args = LAB_SMOKE[name]
    script = LAB / f"{name}.py"
    if ranks is None:
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json_lines(proc.stdout) if name != "negotiation_scale" else json.loads(proc.stdout)  # one object
    return json_lines(run_mpi(script, ranks, args, timeout=300).stdout)


#: arguments a smoke test adds to the registry's (after --): peak_rss measures this checkout a second time, so
#: one run covers the comparison of checkouts beside plain torch and DDP
SMOKE_EXTRA = {"peak_rss": ("--hvdlite-path", f"again={ROOT}")}
#: benchmark name -> the assertions on its smoke run's records
CHECKS: dict[str, Callable[[Records, Path], None]] = {}


def check(name: str) -> Callable[[Callable[[Records, Path], None]], Callable[[Records, Path], None]]:
    def register(function: Callable[[Records, Path], None]) -> Callable[[Records, Path], None]:
        CHECKS[name] = function
        return function
    return register


@pytest.mark.parametrize("name", [b.name for b in BENCHMARKS if b.smoke is not None])
def test_smoke(name: str, tmp_path: Path) -> None:
    """Every smoked benchmark of the registry runs through the entry point and passes its checks."""
    assert name in CHECKS, f"{name} is smoked in benchmarks/registry.py but has no @check here: write its checks"
    CHECKS[name](smoke(name, tmp_path, *SMOKE_EXTRA.get(name, ())), tmp_path)


@pytest.mark.parametrize("name", sorted(LAB_SMOKE))
def test_lab_smoke(name: str, tmp_path: Path) -> None:
    """The cheap scripts of benchmarks/lab/ run and pass their checks."""
    CHECKS[name](lab_smoke(name), tmp_path)


def test_every_script_is_in_the_registry_or_the_lab_readme() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py")} - HELPERS
    registered = {b.path.stem for b in BENCHMARKS if b.path.parent == BENCH}
    assert scripts == registered, ("benchmarks/registry.py must run every script of benchmarks/ (the others go to "
                                   f"benchmarks/lab/): missing {sorted(scripts - registered)}, "
                                   f"gone {sorted(registered - scripts)}")
    for bench in BENCHMARKS:
        assert bench.path.exists() and bench.question and bench.suite in SUITES, bench
        assert bench.peer in ("", "module", "venv", "required") and all("=" in e for e in bench.env), bench
    readme = (LAB / "README.md").read_text()
    for script in LAB.glob("*.py"):
        assert ast.get_docstring(ast.parse(script.read_text())), f"{script.name}: no docstring"
        assert sum(f"`{script.name}`" in line for line in readme.splitlines()) == 1, \
            f"benchmarks/lab/README.md: give {script.name} one line"
    assert set(CHECKS) == {b.name for b in BENCHMARKS if b.smoke is not None} | set(LAB_SMOKE)


def planned(stderr: str) -> dict[str, str]:
    """The runner's --dry-run lines, by benchmark name."""
    lines = [line.split(": ", 2) for line in stderr.splitlines() if line.startswith("benchmarks: ")]
    return {parts[1]: parts[2] for parts in lines if len(parts) == 3 and parts[1] in BY_NAME}


def test_the_entry_point_plans_every_suite_with_and_without_a_horovod_venv(tmp_path: Path) -> None:
    """--dry-run prints each command: the peer comes from the venv (its python and mpiexec with --hvd-module, or
    --horovod-venv), the Keras throughput stays on this Python, a benchmark that needs what was not given is
    skipped with a message, and the gpu suite's runs carry their settings."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "mpiexec"):
        (venv / "bin" / tool).write_text("#!/bin/sh\n")
        (venv / "bin" / tool).chmod(0o755)
    alone = entry_point("--dry-run", "--results", str(tmp_path / "r")).stderr
    assert "no Horovod venv given: skipping Horovod" in alone
    assert "synthetic_vs_horovod skipped: pass --horovod-venv VENV: it compares with Horovod" in alone
    assert "elastic_recovery skipped: pass --ompi-python PY" in alone
    assert set(planned(alone)) == set(SUITES["headline"]) - {"synthetic_vs_horovod", "elastic_recovery"}
    assert "--hvd-module" not in alone and str(venv) not in alone
    ompi = planned(entry_point("--dry-run", "--ompi-python", "/opt/ompi/bin/python", "--results", str(tmp_path)).stderr)
    assert ompi["elastic_recovery"].endswith("elastic_recovery.py --ompi-python /opt/ompi/bin/python")
    lines = planned(entry_point("--dry-run", "--horovod-venv", str(venv), "--results", str(tmp_path / "r")).stderr)
    assert set(lines) == set(SUITES["headline"]) - {"elastic_recovery"}
    for name in ("small_ops", "grad_sync", "train_throughput"):
        assert f"{venv}/bin/python" in lines[name] and lines[name].endswith("--hvd-module horovod.torch"), lines[name]
    assert lines["small_ops"].startswith(f"{venv}/bin/mpiexec -n 2 ")
    for name in ("peak_rss", "synthetic_vs_horovod"):
        assert lines[name].endswith(f"--horovod-venv {venv}"), lines[name]
    assert f"--hvdlite-path {ROOT} " in lines["peak_rss"]
    smoke_peer = entry_point("--smoke", "--dry-run", "--horovod-venv", str(venv), "--results", str(tmp_path)).stderr
    assert "hvdlite.torch" not in smoke_peer  # the smoke runs' stand-ins for Horovod give way to the real one
    assert smoke_peer.count("--hvd-module horovod.torch") == 3 and "--peer-module" not in smoke_peer
    gpu = planned(entry_point("gpu", "--dry-run", "--results", str(tmp_path)).stderr)
    assert set(gpu) == set(SUITES["gpu"])
    assert gpu["gpu_check_staged"].startswith(f"HOROVOD_GPU_OPERATIONS=MPI {sys.executable} -m hvdlite.run -np 2 ")
    assert gpu["gpu_check_staged"].endswith("tests/gpu_check.py") and " -np 4 " in gpu["grad_sync_n4"]
    table = entry_point("--list").stdout
    assert all(f"`{b.name}`" in table for b in BENCHMARKS)


def test_a_failed_benchmark_leaves_the_next_to_run_and_the_exit_status_says_so(tmp_path: Path) -> None:
    """A run that fails (here both, refusing an unknown flag) is reported at the end and the runner exits 1; the
    benchmarks after it still run (a GPU check that fails leaves the timings to come)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--only", "gpu_latency,gpu_latency_fast_cycle",
                           "--no-tables", "--results", str(tmp_path), "--", "--no-such-flag"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr
    tail = proc.stderr.splitlines()[-2:]
    assert tail == ["benchmarks: gpu_latency exited 2 (its stderr is above)",
                    "benchmarks: gpu_latency_fast_cycle exited 2 (its stderr is above)"], proc.stderr


@check("grad_sync")
def check_grad_sync(records: Records, tmp_path: Path) -> None:
    machine = records[0]
    assert machine["kind"] == "machine" and machine["ranks"] == 2 and machine["bench"] == "grad_sync"
    assert records[-1]["kind"] == "done"
    expected = {"mpi_flat_out_of_place", "mpi_flat_in_place", "mpi_flat_chunked_1MB", "mpi_flat_chunked_2MB",
                "mpi_flat_chunked_4MB", "mpi_per_tensor", "gloo_per_tensor", "gloo_flat", "hvdlite_async",
                "hvdlite_grouped", "hvdlite_optimizer", "hvd_module_async", "hvdlite_optimizer_sum",
                "hvdlite_optimizer_predivide"}
    for model, tensors in (("resnet50", 161), ("bert-base", 199)):
        methods = by_method(records, model=model)
        assert set(methods) == expected, (model, sorted(methods))
        limit = methods[next(iter(methods))]["limit_method"]
        assert methods[limit]["group"] == "a" and methods[limit]["ratio"] == 1.0
        for name, r in methods.items():
            assert r["tensors"] == tensors and r["ranks"] == 2 and r["reps"] == 2, r
            assert_positive(r, "ms", "ms_min", "ms_max", "bytes", "bytes_per_s", "ratio")
            assert r["ratio"] >= 1.0 or r["group"] != "a", r  # the denominator is the fastest of (a)
        assert {methods[m]["group"] for m in methods} == {"a", "b", "c", "d", "e", "f", "g", "diag"}
        assert methods["hvd_module_async"]["module"] == "hvdlite.torch"
        assert methods["hvdlite_grouped"]["engine_cycles_per_rep"] >= 1
        assert methods["hvdlite_optimizer"]["mpi_calls_per_rep"] >= 1  # the optimizer's buckets were reduced
        (summary,) = [r for r in records if r.get("kind") == "summary" and r["model"] == model]
        for label in ("optimizer_average_over_sum", "optimizer_sum_over_chunked_1MB",
                      "optimizer_average_over_chunked_1MB"):
            ratio = summary[label]
            assert ratio["rounds"] == 2 and 0 < ratio["min"] <= ratio["median"] <= ratio["max"], (label, ratio)
            assert_positive(ratio, "best_over_best")


LATENCY_KEYS = ("latency_mpi4py", "latency_mpi4py_pickle", "latency_hvdlite", "latency_hvdlite_torch")
INFLIGHT_KEYS = ("inflight_fused", "inflight_unfused", "inflight_hvdlite_torch", "inflight_cold_hvdlite_torch",
                 "inflight_named_hvdlite_torch",
                 "inflight_mpi_loop", "inflight_mpi_one")


@check("small_ops")
def check_small_ops(records: Records, tmp_path: Path) -> None:
    assert records[0]["kind"] == "machine" and records[-1]["kind"] == "done"
    methods = by_method(records)
    assert set(methods) == {*LATENCY_KEYS, *INFLIGHT_KEYS, "idle_cpu_baseline", "idle_cpu_hvdlite"}
    for key in LATENCY_KEYS:
        assert_positive(methods[key], "us", "ratio_to_mpi4py")
        assert "ratio_to_module" not in methods[key]
    for key in INFLIGHT_KEYS:
        assert methods[key]["count"] == 40 and methods[key]["reps"] == 2
        assert_positive(methods[key], "ms", "ops_per_s", "speedup_vs_unfused", "ratio_to_mpi_loop")
    # Fusion really happened: fewer MPI data calls per round than tensors; unfused, one per tensor.
    assert methods["inflight_fused"]["mpi_calls_per_round"] < 40
    assert methods["inflight_hvdlite_torch"]["mpi_calls_per_round"] < 40
    assert methods["inflight_cold_hvdlite_torch"]["mpi_calls_per_round"] < 40
    assert methods["inflight_unfused"]["mpi_calls_per_round"] == 40
    idle = [r for r in records if r.get("method") == "idle_cpu_hvdlite"]
    assert [r["when"] for r in idle] == ["after_init", "after_work", "after_torch_work"]
    for r in idle:
        assert r["cpu_percent"] >= 0 and r["seconds"] == 0.3 and "engine_cycles_per_s" in r
    summary = [r for r in records if r.get("kind") == "summary"]
    assert len(summary) == 1 and summary[0]["module"] is None
    s = summary[0]
    assert s["latency_hvdlite_torch_us"] == methods["latency_hvdlite_torch"]["us"]
    assert s["latency_mpi4py_us"] == methods["latency_mpi4py"]["us"]
    assert s["inflight_hvdlite_torch_ms"] == methods["inflight_cold_hvdlite_torch"]["ms"]  # what a user waits for
    assert s["inflight_warm_hvdlite_torch_ms"] == methods["inflight_hvdlite_torch"]["ms"]  # warm names
    assert s["inflight_mpi4py_ms"] == s["inflight_warm_mpi4py_ms"] == methods["inflight_mpi_loop"]["ms"]
    assert s["inflight_named_hvdlite_torch_ms"] == methods["inflight_named_hvdlite_torch"]["ms"]  # named, out of place
    assert s["inflight_named_best_hvdlite_torch_ms"] == methods["inflight_named_hvdlite_torch"]["ms_min"]
    for measure in ("latency", "inflight", "inflight_named", "inflight_warm"):
        assert s[f"{measure}_module_{'us' if measure == 'latency' else 'ms'}"] is None
        assert s[f"{measure}_hvdlite_torch_over_module"] is None and s[f"{measure}_module_over_mpi4py"] is None
        assert_positive(s, f"{measure}_hvdlite_torch_over_mpi4py")
    # tables.py's from these results: the comparison with a module says it was not measured
    tables = subprocess.run([sys.executable, str(BENCH / "tables.py"), "--results", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert tables.returncode == 0, tables.stderr
    assert "**small_ops, hvdlite.torch vs module (not measured)**" in tables.stdout


def test_small_ops_with_module_smoke(tmp_path: Path) -> None:
    """--hvd-module (hvdlite.torch standing in for horovod.torch) in two alternating sessions: re-init works."""
    records = smoke("small_ops", tmp_path, "--sessions", "2", "--hvd-module", "hvdlite.torch")
    assert records[0]["module"] == "hvdlite.torch"
    methods = by_method(records)
    assert set(methods) == {*LATENCY_KEYS, *INFLIGHT_KEYS, "latency_module", "inflight_module", "inflight_cold_module",
                            "inflight_named_module", "idle_cpu_baseline", "idle_cpu_hvdlite", "idle_cpu_module"}
    assert methods["latency_module"]["module"] == methods["inflight_module"]["module"] == "hvdlite.torch"
    # Two sessions of 2 rounds each; the raw latency also runs in both module sessions.
    assert methods["latency_hvdlite_torch"]["reps"] == methods["latency_module"]["reps"] == 4
    assert methods["latency_mpi4py"]["reps"] == 8
    assert methods["inflight_module"]["reps"] == methods["inflight_hvdlite_torch"]["reps"] == 4
    lat, fl = methods["latency_hvdlite_torch"], methods["inflight_hvdlite_torch"]
    assert_positive(methods["latency_module"], "us", "ratio_to_mpi4py")
    assert_positive(methods["inflight_module"], "ms", "ops_per_s", "ratio_to_mpi_loop")
    assert lat["ratio_to_module"] == pytest.approx(lat["us"] / methods["latency_module"]["us"])
    assert fl["ratio_to_module"] == pytest.approx(fl["ms"] / methods["inflight_module"]["ms"])
    cold = methods["inflight_cold_hvdlite_torch"]
    assert cold["ratio_to_module"] == pytest.approx(cold["ms"] / methods["inflight_cold_module"]["ms"])
    idle = [r for r in records if r.get("method") == "idle_cpu_module"]
    assert [r["when"] for r in idle] == ["after_init", "after_work"]
    assert all(r["module"] == "hvdlite.torch" and r["cpu_percent"] >= 0 for r in idle)
    (s,) = [r for r in records if r.get("kind") == "summary"]
    assert s["module"] == "hvdlite.torch"
    assert s["latency_hvdlite_torch_over_module"] == pytest.approx(lat["ratio_to_module"])
    assert s["inflight_hvdlite_torch_over_module"] == pytest.approx(cold["ratio_to_module"])
    assert s["inflight_warm_hvdlite_torch_over_module"] == pytest.approx(fl["ratio_to_module"])
    named = methods["inflight_named_hvdlite_torch"]
    assert s["inflight_named_hvdlite_torch_over_module"] == pytest.approx(
        named["ms"] / methods["inflight_named_module"]["ms"])
    assert s["inflight_named_best_hvdlite_torch_over_module"] == pytest.approx(
        named["ms_min"] / methods["inflight_named_module"]["ms_min"])
    assert s["latency_module_over_mpi4py"] == pytest.approx(methods["latency_module"]["ratio_to_mpi4py"])
    assert s["inflight_module_over_mpi4py"] == pytest.approx(methods["inflight_cold_module"]["ratio_to_mpi_loop"])
    assert s["inflight_warm_module_over_mpi4py"] == pytest.approx(methods["inflight_module"]["ratio_to_mpi_loop"])


def check_train_throughput(framework: str, records: Records) -> None:
    assert not [r for r in records if r.get("kind") == "error"], records
    assert {r["framework"] for r in records if r.get("kind") == "done"} == {framework}
    expected = {"single", "independent", "hvdlite", "ddp", "hvd_module"} if framework == "torch" else \
        {"single", "independent", "hvdlite"}
    methods = by_method(records, framework=framework, model="transformer")  # (the smoke's one model)
    assert set(methods) == expected, (framework, sorted(methods))
    assert methods["single"]["ranks"] == 1 and "scaling_efficiency" not in methods["single"]
    machine = methods["independent"]  # the machine's own limit, measured in the same rounds
    assert "of_machine" not in machine and "of_machine" not in methods["single"]
    for name, r in methods.items():
        assert_positive(r, "step_ms", "samples_per_s", "parameters")
        if name != "single":
            assert r["ranks"] == 2
            assert_positive(r, "scaling_efficiency")
            assert r["samples_per_s"] == pytest.approx(2 * r["batch_per_rank"] / (r["step_ms"] / 1e3))
        if name not in ("single", "independent"):
            assert r["of_machine"] == pytest.approx(r["scaling_efficiency"] / machine["scaling_efficiency"])
    if framework == "torch":
        assert_positive(methods["hvdlite"], "vs_ddp", "vs_hvd_module")
        assert methods["hvdlite"]["vs_hvd_module"] == pytest.approx(
            methods["hvdlite"]["samples_per_s"] / methods["hvd_module"]["samples_per_s"])


check("train_throughput")(lambda records, _: check_train_throughput("torch", records))
check("keras_throughput")(lambda records, _: check_train_throughput("keras", records))


def test_tables_regenerate_from_json() -> None:
    """tables.py prints every headline table from JSON lines in the benchmarks' format (the committed results)."""
    proc = subprocess.run([sys.executable, str(BENCH / "tables.py")], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for table in ("**grad_sync, resnet50**", "**train_throughput**", "**small_ops**", "**peak_rss**",
                  "**synthetic_vs_horovod**"):
        assert table in proc.stdout, (table, proc.stdout)


@check("hw_scaling")
def check_hw_scaling(records: Records, tmp_path: Path) -> None:
    """The machine-limit benchmark reports, per model, one rank alone against every rank at once."""
    models = {r["model"]: r for r in records if r.get("bench") == "hw_scaling" and "model" in r}
    assert set(models) == {"resnet50", "transformer"}
    for record in models.values():
        assert record["ranks"] == 2
        assert_positive(record, "alone_ms", "together_ms", "efficiency")
        assert record["efficiency"] == pytest.approx(record["alone_ms"] / record["together_ms"])


@check("latency_breakdown")
def check_latency_breakdown(records: Records, tmp_path: Path) -> None:
    """The latency breakdown reports every phase of a synchronous allreduce, in order, from rank 0."""
    phases = [r for r in records if "phase" in r]
    assert [r["phase"] for r in phases] == ["submitted", "cycle_start", "negotiation_start", "negotiation_end",
                                            "data_start", "completed", "woken"]
    for record in phases:
        assert_positive(record, "us_since_call", "p10", "p90")
    assert phases[-1]["us_since_call"] >= phases[0]["us_since_call"]


@check("peer_wait")
def check_peer_wait(records: Records, tmp_path: Path) -> None:
    """Rank 0's compute time with the others waiting outside any library and in hvdlite (and the stand-in
    module), each session's slowdown against its own baseline, and the waiting ranks' CPU."""
    lines = [r for r in records if r.get("bench") == "peer_wait" and "method" in r]
    assert [(r["session"], r["method"]) for r in lines] == [("hvdlite", "sleep"), ("hvdlite", "hvdlite"),
                                                          ("hvdlite.torch", "sleep"), ("hvdlite.torch", "module")]
    for record in lines:
        assert_positive(record, "compute_seconds", "slowdown")
        assert record["waiting_cpu_percent"] >= 0
    sleep, waited = lines[0], lines[1]
    assert sleep["slowdown"] == 1.0 and waited["slowdown"] == pytest.approx(
        waited["compute_seconds"] / sleep["compute_seconds"])


@check("gloo_vs_mpi")
def check_gloo_vs_mpi(records: Records, tmp_path: Path) -> None:
    """Both planes run ResNet-50's 161 gradients (shrunk) and the line carries their times and ratio."""
    (record,) = [r for r in records if r.get("bench") == "gloo_vs_mpi"]
    assert record["tensors"] == 161
    assert_positive(record, "mpi_ms", "gloo_ms", "gloo_over_mpi")
    ratio = record["gloo_ms"] / record["mpi_ms"]  # from times rounded to 0.01 ms: allow exactly that rounding
    slack = ratio * (0.005 / record["mpi_ms"] + 0.005 / record["gloo_ms"]) + 0.0005
    assert abs(record["gloo_over_mpi"] - ratio) <= slack, (record, ratio, slack)


@check("gpu_overhead")
def check_gpu_overhead(records: Records, tmp_path: Path) -> None:
    """Without CUDA the GPU overhead script runs its tiny CPU version to the end and says so."""
    (record,) = records
    assert record["device"] == "cpu (smoke test)" and record["ranks"] == 1
    assert_positive(record, "torch_step_ms", "hvdlite_step_ms", "forced_step_ms")


def test_gpu_latency_says_no_cuda_device_without_one() -> None:
    """gpu_latency.py says "no CUDA device" and exits 0 where there is none."""
    import torch
    proc = run_mpi(BENCH / "gpu_latency.py", 1, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if not torch.cuda.is_available():
        assert json_lines(proc.stdout) == [{"bench": "gpu_latency", "kind": "skipped", "reason": "no CUDA device",
                                            "ranks": 1}]


@check("gpu_latency")
def check_gpu_latency(records: Records, tmp_path: Path) -> None:
    """--dry-run-cpu (the smoke run) runs every measure (gloo standing in for NCCL, STAGE_HOST_COPIES for
    staging) to the summary line."""
    assert records[-1]["kind"] == "done"
    methods = by_method(records, bench="gpu_latency")
    assert set(methods) == {"latency_hvdlite", "latency_direct", "latency_staged", "inflight_hvdlite",
                            "inflight_direct", "inflight_staged", "inflight_cold_hvdlite"}
    (summary,) = [r for r in records if r.get("kind") == "summary"]
    lat, inflight = methods["latency_hvdlite"], methods["inflight_hvdlite"]
    assert summary["latency_hvdlite_over_direct"] == lat["us"] / methods["latency_direct"]["us"]
    assert summary["inflight_hvdlite_over_direct"] == inflight["ms"] / methods["inflight_direct"]["ms"]
    assert methods["inflight_hvdlite"]["count"] == 20 and summary["dry_run_cpu"] is True



@check("powersgd_bytes")
def check_powersgd_bytes(records: Records, tmp_path: Path) -> None:
    assert records[-1]["kind"] == "done"
    methods = by_method(records)
    assert set(methods) == {"powersgd_rank1", "powersgd_rank2", "uncompressed"}
    full = methods["uncompressed"]["bytes_per_step"]
    assert full == 7_357_194 * 4 and methods["uncompressed"]["ratio"] == 1.0
    one, two = methods["powersgd_rank1"], methods["powersgd_rank2"]
    assert 0 < one["bytes_per_step"] < two["bytes_per_step"] < full, (one, two)
    assert one["ratio"] == one["bytes_per_step"] / full and one["tensors_compressed"] > 0 and one["ranks"] == 2


@check("peak_rss")
def check_peak_rss(records: Records, tmp_path: Path) -> None:
    """peak_rss.py measures plain torch, DDP and each --hvdlite-path in its own fresh job, with hvdlite imported
    from that checkout, and compares the first with the others (here this checkout twice: the runner gives it
    first, SMOKE_EXTRA adds it again as "again")."""
    (summary,) = [r for r in records if r.get("kind") == "summary"]
    assert set(summary["configs"]) == {"single", "ddp", summary["subject"], "hvdlite:again"}  # no Horovod
    assert summary["configs"]["single"]["ranks"] == 1 and summary["configs"]["ddp"]["ranks"] == 2
    assert_positive(summary, "over_ddp", "over_single")
    runs = [r for r in records if r.get("kind") == "run" and r["config"].startswith("hvdlite")]
    assert [r["config"] for r in runs][1] == "hvdlite:again" and len(runs) == 2
    for run in runs:
        assert run["ranks"] == 2 and [r["rank"] for r in run["per_rank"]] == [0, 1]
        assert run["peak_rss_mb"] == max(r["peak_rss_mb"] for r in run["per_rank"])
        for rank in run["per_rank"]:
            assert Path(rank["module_file"]).resolve() == ROOT / "hvdlite" / "__init__.py"
            assert rank["peak_rss_mb"] >= rank["rss_after_model_mb"] > 0
    first, again = (summary["configs"][r["config"]]["peak_rss_mb"] for r in runs)
    assert summary["subject"] == runs[0]["config"]
    assert summary["over_hvdlite:again"] == round(first / again, 4)


def test_peak_rss_refuses_a_checkout_without_hvdlite(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, str(BENCH / "peak_rss.py"), "--hvdlite-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and f"{tmp_path} has no hvdlite package" in bad.stderr


@check("synthetic_vs_horovod")
def check_synthetic_vs_horovod(records: Records, tmp_path: Path) -> None:
    """The synthetic-benchmark driver launches the example once per side and round (hvdlite.torch standing in
    for horovod.torch) and reports each launch's img/sec and the ratio."""
    runs = {r["side"]: r for r in records if r.get("kind") == "run"}
    assert set(runs) == {"hvdlite", "peer"} and runs["peer"]["module"] == "hvdlite.torch"
    for run in runs.values():
        assert run["ranks"] == 2 and len(run["iter_img_per_s_per_rank"]) == 2
        assert_positive(run, "total_img_per_s", "cpu_s")
    (summary,) = [r for r in records if r.get("kind") == "summary"]
    assert summary["hvdlite_over_peer"] == pytest.approx(runs["hvdlite"]["total_img_per_s"]
                                                          / runs["peer"]["total_img_per_s"])
    assert summary["round_ratios"] == [pytest.approx(summary["hvdlite_over_peer"])]
    assert summary["hvdlite_cpu_s"] == runs["hvdlite"]["cpu_s"] and summary["peer_cpu_s"] == runs["peer"]["cpu_s"]


@check("zero_memory")
def check_zero_memory(records: Records, tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer's state really is 1/N of DistributedOptimizer's."""
    jobs = {(r["optimizer"], r["ranks"]): r for r in records if "optimizer" in r}
    assert sorted(jobs) == [("dist", 1), ("dist", 2), ("zero", 1), ("zero", 2)]
    full = 2 * jobs["dist", 1]["model_bytes"]  # AdamW's two moments
    assert [p["state_bytes"] for p in jobs["dist", 2]["per_rank"]] == [full, full]
    for p in jobs["zero", 2]["per_rank"]:  # half, plus under one padding element per bucket and moment
        assert full / 2 <= p["state_bytes"] <= full / 2 + 2 * 4 * 199, p
    summary = records[-1]
    assert summary["kind"] == "summary" and [row["ranks"] for row in summary["rows"]] == [1, 2]


@check("zero_throughput")
def check_zero_throughput(records: Records, tmp_path: Path) -> None:
    rates = {r["method"]: r["samples_per_s"] for r in records if "method" in r}
    assert sorted(rates) == ["hvdlite_distributed", "hvdlite_zero", "torch_zero_ddp_gloo"]
    assert all(rate > 0 for rate in rates.values())
    assert {"zero_vs_distributed", "zero_vs_torch_zero"} <= set(records[-1])


@check("negotiation_scale")
def check_negotiation_scale(report: Records, tmp_path: Path) -> None:
    """One job of 2 ranks: a cached step is the bit vector alone (8 + cache_capacity / 8 bytes a cycle), a first
    step a vote (no rank's table gathered), an unnamed op of a loop the bit vector alone (agreed by position)."""
    assert report["benchmark"] == "negotiation_scale"
    (result,) = report["results"]
    assert result["ranks"] == 2 and result["tensors_per_step"] == 2
    cached, first, unnamed = (result["per_rank_mean"][path] for path in ("cached", "first", "unnamed"))
    assert cached["full_cycles"] == 0 and cached["bitvector_bytes"] == (8 + 1024 / 8) * cached["cycles"]
    assert first["explain_cycles"] == 0 and first["full_path_bytes"] == 0 and first["vote_bytes"] > 0
    assert unnamed["full_cycles"] == 0 and unnamed["vote_bytes"] == 0
    assert cached["negotiation_calls"] == cached["cycles"] > 0 and first["negotiation_calls"] > first["cycles"]
    assert result["raw_mpi_vector_allreduce_us"] > 0 and result["raw_mpi_allreduce_us"] > 0  # the model's check
    assert all(path["median_ms"] > 0 and path["cpu_ms"] > 0 for path in (cached, first, unnamed))


@check("profile_step")
def check_profile_step(records: Records, tmp_path: Path) -> None:
    """Every method's step splits into phases that add up, with the CPU of each thread."""
    assert records[0]["kind"] == "machine" and records[0]["model"] == "transformer"
    methods = by_method(records)
    assert set(methods) == {"single", "hvdlite", "overlap", "ddp", "deferred"}
    for name, r in methods.items():
        assert_positive(r, "forward_ms", "backward_ms", "update_ms", "step_ms")
        assert r["sync_ms"] >= 0 and r["cpu_ms_main"] >= 0 and r["cpu_ms_engine"] >= 0, r
        phases = r["forward_ms"] + r["backward_ms"] + r["sync_ms"] + r["update_ms"]
        assert phases == pytest.approx(r["step_ms"], rel=0.05), r


def check_grad_sync_ranks(records: Records, ranks: int) -> None:
    """The gpu suite's gradient-sync runs on CPU tensors: the raw non-blocking loops and the optimizer's sync."""
    methods = {r["method"] for r in records if "method" in r}
    assert {"mpi_nb_pipe_1MB", "mpi_nb_pipe_avg_1MB", "hvdlite_optimizer_sum"} <= methods, methods
    assert {r["ranks"] for r in records if "method" in r} == {ranks}


check("grad_sync_n2")(lambda records, _: check_grad_sync_ranks(records, 2))
check("grad_sync_n4")(lambda records, _: check_grad_sync_ranks(records, 4))
