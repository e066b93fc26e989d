"""Smoke runs of the benchmarks with tiny sizes at 2 ranks: well-formed JSON lines with every method.

Benchmarks are not tests: nothing here looks at a timing, only that each benchmark still runs and reports.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_mpi

BENCH = ROOT / "benchmarks"


def json_lines(text: str) -> list[dict]:
    """Every line of the output is one JSON object (the benchmarks print nothing else on stdout)."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "the benchmark printed nothing"
    return [json.loads(line) for line in lines]


def by_method(records: list[dict], **match: object) -> dict[str, dict]:
    return {r["method"]: r for r in records if "method" in r and all(r.get(k) == v for k, v in match.items())}


def assert_positive(record: dict, *keys: str) -> None:
    for key in keys:
        value = record[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, record)


def test_grad_sync_smoke(tmp_path: Path) -> None:
    out = tmp_path / "grad_sync.json"
    proc = run_mpi(BENCH / "grad_sync.py", 2, timeout=240, args=[
        "--scale", "0.0005", "--reps", "2", "--warmup", "1", "--hvd-module", "hvdlite.torch", "--out", str(out)])
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    machine = records[0]
    assert machine["kind"] == "machine" and machine["ranks"] == 2 and machine["bench"] == "grad_sync"
    assert records[-1]["kind"] == "done"
    expected = {"mpi_flat_out_of_place", "mpi_flat_in_place", "mpi_flat_chunked_1MB", "mpi_flat_chunked_2MB",
                "mpi_flat_chunked_4MB", "mpi_per_tensor", "mpi_fused_copy", "gloo_per_tensor", "gloo_flat",
                "hvdlite_async", "hvdlite_async_sum", "hvdlite_grouped", "hvdlite_optimizer", "hvd_module_async",
                "hvdlite_optimizer_inflight1", "hvdlite_optimizer_inflight2"}
    expected |= {f"mpi_nb_{how}_{mb}MB" for how in ("wait", "test", "test_avg") for mb in (1, 2, 4)}
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


LATENCY_KEYS = ("latency_mpi4py", "latency_mpi4py_pickle", "latency_hvdlite", "latency_hvdlite_torch")
INFLIGHT_KEYS = ("inflight_fused", "inflight_unfused", "inflight_hvdlite_torch", "inflight_cold_hvdlite_torch",
                 "inflight_mpi_loop", "inflight_mpi_one")


def run_small_ops(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / "small_ops.json"
    proc = run_mpi(BENCH / "small_ops.py", 2, timeout=180, args=[
        "--iters", "20", "--reps", "2", "--inflight", "40", "--idle-seconds", "0.3", *extra, "--out", str(out)])
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    assert records[0]["kind"] == "machine" and records[-1]["kind"] == "done"
    return records


def test_small_ops_smoke(tmp_path: Path) -> None:
    records = run_small_ops(tmp_path, "--sessions", "1")
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
    for measure in ("latency", "inflight", "inflight_warm"):
        assert s[f"{measure}_module_{'us' if measure == 'latency' else 'ms'}"] is None
        assert s[f"{measure}_hvdlite_torch_over_module"] is None and s[f"{measure}_module_over_mpi4py"] is None
        assert_positive(s, f"{measure}_hvdlite_torch_over_mpi4py")


def test_small_ops_with_module_smoke(tmp_path: Path) -> None:
    """--hvd-module (hvdlite.torch standing in for horovod.torch) in two alternating sessions: re-init works."""
    records = run_small_ops(tmp_path, "--sessions", "2", "--hvd-module", "hvdlite.torch")
    assert records[0]["module"] == "hvdlite.torch"
    methods = by_method(records)
    assert set(methods) == {*LATENCY_KEYS, *INFLIGHT_KEYS, "latency_module", "inflight_module", "inflight_cold_module",
                            "idle_cpu_baseline", "idle_cpu_hvdlite", "idle_cpu_module"}
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
    assert s["latency_module_over_mpi4py"] == pytest.approx(methods["latency_module"]["ratio_to_mpi4py"])
    assert s["inflight_module_over_mpi4py"] == pytest.approx(methods["inflight_cold_module"]["ratio_to_mpi_loop"])
    assert s["inflight_warm_module_over_mpi4py"] == pytest.approx(methods["inflight_module"]["ratio_to_mpi_loop"])


def test_train_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "train_throughput.json"
    cmd = [sys.executable, str(BENCH / "train_throughput.py"), "--np", "2", "--tiny", "--steps", "2",
           "--rounds", "1", "--warmup", "1", "--keras-models", "transformer", "--hvd-module", "hvdlite.torch",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    assert not [r for r in records if r.get("kind") == "error"], records
    done = {r["framework"] for r in records if r.get("kind") == "done"}
    assert done == {"torch", "keras"}
    for framework, expected, models in (("torch", {"single", "independent", "hvdlite", "ddp", "hvd_module"},
                                         ("resnet50", "transformer")),
                                        ("keras", {"single", "independent", "hvdlite"}, ("transformer",))):
        for model in models:
            methods = by_method(records, framework=framework, model=model)
            assert set(methods) == expected, (framework, model, sorted(methods))
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


def test_plot_regenerates_from_json(tmp_path: Path) -> None:
    """plot.py draws the PNG from JSON lines in the benchmarks' format (here the committed results)."""
    source = BENCH / "results"
    if not (source / "grad_sync.json").exists():
        pytest.fail("benchmarks/results/grad_sync.json is missing: run the benchmarks (see benchmarks/README.md)")
    png = tmp_path / "plot.png"
    proc = subprocess.run([sys.executable, str(BENCH / "plot.py"), "--results", str(source), "--out", str(png)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_autotune_smoke(tmp_path: Path) -> None:
    """The autotune benchmark runs, finishes tuning within its budget and reports every configuration."""
    out = tmp_path / "autotune.json"
    proc = run_mpi(BENCH / "autotune.py", 2, timeout=240, args=[
        "--scale", "0.0005", "--reps", "1", "--rounds", "1", "--warmup-samples", "0", "--steps-per-sample", "2",
        "--max-samples", "3", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    tuning = [r for r in records if r.get("kind") == "tuning"]
    assert len(tuning) == 1 and tuning[0]["finished"] is True
    configs = {r["config"]: r for r in records if r.get("kind") == "config"}
    assert {"bad_start", "autotuned", "default_4MB_1ms_1MB"} <= set(configs)
    assert configs["autotuned"]["settings"] == tuning[0]["chosen"]
    for record in configs.values():
        assert_positive(record, "ms", "bytes_per_s")
    summary = [r for r in records if r.get("kind") == "summary"]
    assert len(summary) == 1 and summary[0]["best_hand_set"] in configs
    assert_positive(summary[0], "autotuned_over_best_hand_set")


def test_run_all_smoke_without_horovod(tmp_path: Path) -> None:
    """run_all.sh --smoke with no Horovod venv: says it skips Horovod and writes every results file."""
    proc = subprocess.run(["bash", str(BENCH / "run_all.sh"), "--smoke", "--results", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no Horovod venv given: skipping Horovod" in proc.stderr
    small = json_lines((tmp_path / "small_ops.json").read_text())
    assert "latency_module" not in by_method(small) and "latency_hvdlite_torch" in by_method(small)
    grad = json_lines((tmp_path / "grad_sync.json").read_text())
    assert "hvd_module_async" not in by_method(grad, model="resnet50") and grad[-1]["kind"] == "done"
    train = json_lines((tmp_path / "train_throughput.json").read_text())
    assert {r["framework"] for r in train if r.get("kind") == "done"} == {"torch", "keras"}
    assert not [r for r in train if r.get("kind") in ("error", "skipped")], train
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "**small_ops, hvdlite.torch vs module (not measured)**" in proc.stdout
    hw = json_lines((tmp_path / "hw_scaling.json").read_text())
    assert {r["model"] for r in hw if "efficiency" in r} == {"resnet50", "transformer"}
    rss = json_lines((tmp_path / "peak_rss.json").read_text())
    (summary,) = [r for r in rss if r.get("kind") == "summary"]
    assert set(summary["configs"]) == {"single", "ddp", summary["subject"]}  # no Horovod, no baseline given
    assert summary["configs"]["single"]["ranks"] == 1 and summary["configs"]["ddp"]["ranks"] == 2
    assert_positive(summary, "over_ddp", "over_single")
    assert not (tmp_path / "synthetic_vs_horovod.json").exists()
    assert "synthetic_vs_horovod skipped" in proc.stderr
    assert "**peak_rss**" in proc.stdout and "**hw_scaling**" in proc.stdout


def test_hw_scaling_smoke(tmp_path: Path) -> None:
    """The machine-limit benchmark reports, per model, one rank alone against every rank at once."""
    out = tmp_path / "hw_scaling.json"
    proc = run_mpi(BENCH / "hw_scaling.py", 2, timeout=240, args=[
        "--tiny", "--steps", "1", "--rounds", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    models = {r["model"]: r for r in records if r.get("bench") == "hw_scaling" and "model" in r}
    assert set(models) == {"resnet50", "transformer"}
    for record in models.values():
        assert record["ranks"] == 2
        assert_positive(record, "alone_ms", "together_ms", "efficiency")
        assert record["efficiency"] == pytest.approx(record["alone_ms"] / record["together_ms"])


def test_latency_breakdown_smoke(tmp_path: Path) -> None:
    """The latency breakdown reports every phase of a synchronous allreduce, in order, from rank 0."""
    out = tmp_path / "latency.json"
    proc = run_mpi(BENCH / "latency_breakdown.py", 2, timeout=120, args=["--ops", "20", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    phases = [r for r in records if "phase" in r]
    assert [r["phase"] for r in phases] == ["submitted", "cycle_start", "negotiation_start", "negotiation_end",
                                            "data_start", "completed", "woken"]
    for record in phases:
        assert_positive(record, "us_since_call", "p10", "p90")
    assert phases[-1]["us_since_call"] >= phases[0]["us_since_call"]


def test_gloo_vs_mpi_smoke() -> None:
    """Both planes run ResNet-50's 161 gradients (shrunk) and the line carries their times and ratio."""
    proc = run_mpi(BENCH / "gloo_vs_mpi.py", 2, timeout=180, args=["--scale", "0.001", "--reps", "1", "--rounds", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = [r for r in json_lines(proc.stdout) if r.get("bench") == "gloo_vs_mpi"]
    assert record["tensors"] == 161
    assert_positive(record, "mpi_ms", "gloo_ms", "gloo_over_mpi")
    ratio = record["gloo_ms"] / record["mpi_ms"]  # from times rounded to 0.01 ms: allow exactly that rounding
    slack = ratio * (0.005 / record["mpi_ms"] + 0.005 / record["gloo_ms"]) + 0.0005
    assert abs(record["gloo_over_mpi"] - ratio) <= slack, (record, ratio, slack)


def test_gpu_overhead_smoke_without_a_gpu() -> None:
    """Without CUDA the GPU overhead script runs its tiny CPU version to the end and says so."""
    proc = run_mpi(BENCH / "gpu_overhead.py", 1, timeout=180, args=["--rounds", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json_lines(proc.stdout)
    assert record["device"] == "cpu (smoke test)" and record["ranks"] == 1
    assert_positive(record, "torch_step_ms", "hvdlite_step_ms", "forced_step_ms")


def test_gpu_latency_smoke(tmp_path: Path) -> None:
    """gpu_latency.py says "no CUDA device" and exits 0 where there is none; its --dry-run-cpu runs every measure
    (gloo standing in for NCCL, stage_host_copies for staging) to the summary line."""
    import torch
    proc = run_mpi(BENCH / "gpu_latency.py", 1, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if not torch.cuda.is_available():
        assert json_lines(proc.stdout) == [{"bench": "gpu_latency", "kind": "skipped", "reason": "no CUDA device",
                                            "ranks": 1}]
    out = tmp_path / "gpu_latency.json"
    proc = run_mpi(BENCH / "gpu_latency.py", 1, timeout=240, args=[  # -n 1: the cheapest run of every path
        "--dry-run-cpu", "--iters", "5", "--inflight", "20", "--rounds", "1", "--out", str(out)])
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text()) and records[-1]["kind"] == "done"
    methods = by_method(records, bench="gpu_latency")
    assert set(methods) == {"latency_hvdlite", "latency_direct", "latency_staged", "inflight_hvdlite",
                            "inflight_direct", "inflight_staged", "inflight_cold_hvdlite"}
    (summary,) = [r for r in records if r.get("kind") == "summary"]
    lat, inflight = methods["latency_hvdlite"], methods["inflight_hvdlite"]
    assert summary["latency_hvdlite_over_direct"] == lat["us"] / methods["latency_direct"]["us"]
    assert summary["inflight_hvdlite_over_direct"] == inflight["ms"] / methods["inflight_direct"]["ms"]
    assert methods["inflight_hvdlite"]["count"] == 20 and summary["dry_run_cpu"] is True


def test_powersgd_bytes_smoke(tmp_path: Path) -> None:
    out = tmp_path / "powersgd_bytes.json"
    proc = run_mpi(BENCH / "powersgd_bytes.py", 2, timeout=240, args=[
        "--model", "small-transformer", "--steps", "1", "--ranks", "1,2", "--out", str(out)])
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text()) and records[-1]["kind"] == "done"
    methods = by_method(records)
    assert set(methods) == {"powersgd_rank1", "powersgd_rank2", "uncompressed"}
    full = methods["uncompressed"]["bytes_per_step"]
    assert full == 7_357_194 * 4 and methods["uncompressed"]["ratio"] == 1.0
    one, two = methods["powersgd_rank1"], methods["powersgd_rank2"]
    assert 0 < one["bytes_per_step"] < two["bytes_per_step"] < full, (one, two)
    assert one["ratio"] == one["bytes_per_step"] / full and one["tensors_compressed"] > 0 and one["ranks"] == 2


def test_diagnostics_smoke(tmp_path: Path) -> None:
    """The diagnostics benchmark reports every setting's small-op and gradient-sync times, the call-site check
    and check_replicas against a (tiny) ResNet-50 step."""
    out = tmp_path / "diagnostics.json"
    proc = run_mpi(BENCH / "diagnostics.py", 2, timeout=300, args=[
        "--reps", "1", "--sessions", "1", "--inflight", "20", "--scale", "0.001", "--batch", "1", "--image", "32",
        "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    methods = by_method(records, bench="diagnostics")
    for what in ("small_ops", "grad_sync"):
        assert_positive(methods[f"{what}_default"], "ms", "straggler_overhead")
        assert_positive(methods[f"{what}_stragglers_off"], "ms")
        assert_positive(methods[f"{what}_deterministic"], "ms", "deterministic_cost")
    for what in ("small_ops", "grad_sync"):  # CPU time per op with straggler attribution on and off
        cpu = methods[f"straggler_cpu_{what}"]
        assert_positive(cpu, "engine_us_per_op_on", "engine_us_per_op_off", "submit_us_per_op_on", "record_us_per_op",
                        "attributed_us_per_op", "attributed_share")
        assert cpu["instrumented_ops"] >= 2000 and cpu["full_rounds_per_op_on"] <= cpu["full_rounds_per_op_off"] + 0.01
    assert_positive(methods["callsite_check"], "callsite_capture_us", "small_op_us")
    assert_positive(methods["resnet50_train_step"], "ms", "check_replicas_module_ms", "check_replicas_optimizer_ms",
                    "module_ratio_to_step", "optimizer_ratio_to_step")


def test_peak_rss_smoke_two_checkouts(tmp_path: Path) -> None:
    """peak_rss.py measures each --hvdlite-path in its own fresh job, with hvdlite imported from that checkout,
    and compares the first with the others (here the same checkout twice; run_all's smoke covers single and DDP)."""
    out = tmp_path / "peak_rss.json"
    cmd = [sys.executable, str(BENCH / "peak_rss.py"), "--model", "tiny", "--steps", "1", "--repeats", "1",
           "--no-single", "--no-ddp", "--hvdlite-path", str(ROOT), "--hvdlite-path", f"again={ROOT}",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
    runs = [r for r in records if r.get("kind") == "run"]
    assert [r["config"] for r in runs][1] == "hvdlite:again" and len(runs) == 2
    for run in runs:
        assert run["ranks"] == 2 and [r["rank"] for r in run["per_rank"]] == [0, 1]
        assert run["peak_rss_mb"] == max(r["peak_rss_mb"] for r in run["per_rank"])
        for rank in run["per_rank"]:
            assert Path(rank["module_file"]).resolve() == ROOT / "hvdlite" / "__init__.py"
            assert rank["peak_rss_mb"] >= rank["rss_after_model_mb"] > 0
    (summary,) = [r for r in records if r.get("kind") == "summary"]
    first, again = (summary["configs"][r["config"]]["peak_rss_mb"] for r in runs)
    assert summary["subject"] == runs[0]["config"]
    assert summary["over_hvdlite:again"] == round(first / again, 4)
    bad = subprocess.run([sys.executable, str(BENCH / "peak_rss.py"), "--hvdlite-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and f"{tmp_path} has no hvdlite package" in bad.stderr


def test_synthetic_vs_horovod_smoke(tmp_path: Path) -> None:
    """The synthetic-benchmark driver launches the example once per side and round (hvdlite.torch standing in
    for horovod.torch) and reports each launch's img/sec and the ratio."""
    out = tmp_path / "synth.json"
    cmd = [sys.executable, str(BENCH / "synthetic_vs_horovod.py"), "--rounds", "1", "--peer-module", "hvdlite.torch",
           "--out", str(out), "--", "--model", "resnet18", "--batch-size", "2", "--image-size", "32",
           "--num-classes", "10", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
           "--num-iters", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json_lines(proc.stdout)
    assert records == json_lines(out.read_text())
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
