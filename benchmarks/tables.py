"""The benchmarks' figures as Markdown tables, from the JSON lines of a run (python -m benchmarks prints them).

Run: python benchmarks/tables.py [--results benchmarks/results]
Reads grad_sync, train_throughput, small_ops, peak_rss and synthetic_vs_horovod's .json (any may be missing).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def results(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "method" in r]


def markdown_tables(grad: list[dict[str, Any]], train: list[dict[str, Any]],
                    small: list[dict[str, Any]]) -> str:
    """The figures as Markdown tables, as the README shows them."""
    out: list[str] = []
    rows = results(grad)
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        first = sub[0]
        out.append(f"**grad_sync, {model}** ({first['tensors']} tensors, {first['bytes'] / 1e6:.1f} MB, "
                   f"{first['ranks']} ranks, median of {first['reps']}):\n")
        out.append("| group | method | ms | GB/s | ratio to (a) |")
        out.append("|---|---|---:|---:|---:|")
        for r in sub:
            out.append(f"| {r['group']} | {r['method']} | {r['ms']:.1f} | {r['bytes_per_s'] / 1e9:.2f} | "
                       f"{r['ratio']:.2f} |")
        out.append("")
    rows = results(train)
    if rows:
        out.append("**train_throughput** (samples/s over all ranks, median round):\n")
        out.append("| framework | model | method | ranks | step ms | samples/s | scaling eff. | of machine's | "
                   "vs DDP | vs module |")
        out.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            cells = [f"{r[key]:.2f}" if key in r else "" for key in ("scaling_efficiency", "of_machine", "vs_ddp",
                                                                     "vs_hvd_module")]
            out.append(f"| {r['framework']} | {r['model']} | {r['method']} | {r['ranks']} | {r['step_ms']:.0f} | "
                       f"{r['samples_per_s']:.2f} | {' | '.join(cells)} |")
        out.append("")
    rows = results(small)
    if rows:
        out.append("**small_ops**:\n")
        out.append("| method | figure | ratio |")
        out.append("|---|---|---:|")
        for r in rows:
            if "us" in r:
                out.append(f"| {r['method']} | {r['us']:.1f} us per call | {r['ratio_to_mpi4py']:.1f}x raw |")
            elif "ms" in r:
                out.append(f"| {r['method']} | {r['count']} ops in {r['ms']:.1f} ms "
                           f"({r['ms'] * 1e3 / r['count']:.1f} us/op) | {r['speedup_vs_unfused']:.2f}x unfused |")
            elif "cpu_percent" in r:
                when = f" ({r['when']})" if "when" in r else ""
                out.append(f"| {r['method']}{when} | {r['cpu_percent']:.3f}% of a core | |")
        out.append("")
    summary = next((r for r in small if r.get("kind") == "summary"), None)
    if summary:
        out.append(summary_table(summary))
    return "\n".join(out)


def summary_table(s: dict[str, Any]) -> str:
    """small_ops' summary line as the issue's table: hvdlite.torch, the module and raw mpi4py, with ratios."""
    module = s.get("module") or "module (not measured)"

    def fig(value: Any, unit: str) -> str:
        return "" if value is None else f"{value:.1f} {unit}"

    def ratio(value: Any) -> str:
        return "" if value is None else f"{value:.2f}x"

    rows = [f"**small_ops, hvdlite.torch vs {module}** ({s['ranks']} ranks, {s['elems']} floats):\n",
            f"| measure (median; best) | hvdlite.torch | {module} | raw mpi4py | hvdlite.torch / module | "
            "hvdlite.torch / raw | module / raw |", "|---|---:|---:|---:|---:|---:|---:|"]
    n = s["count"]
    for measure, label, unit in (("latency", "one allreduce_, synchronous", "us"),
                                 ("inflight_named", f"{n} allreduce_async(t, name=...), warm", "ms"),
                                 ("inflight_warm", f"{n} allreduce_async_(t, name=...), warm", "ms"),
                                 ("inflight", f"{n} unnamed allreduce_async(t)", "ms")):
        if f"{measure}_hvdlite_torch_{unit}" not in s:
            continue
        best = s.get(f"{measure}_best_hvdlite_torch_over_module")
        rows.append(f"| {label} | {fig(s[f'{measure}_hvdlite_torch_{unit}'], unit)}; "
                    f"{fig(s.get(f'{measure}_best_hvdlite_torch_{unit}'), unit)} | "
                    f"{fig(s[f'{measure}_module_{unit}'], unit)}; "
                    f"{fig(s.get(f'{measure}_best_module_{unit}'), unit)} | "
                    f"{fig(s[f'{measure}_mpi4py_{unit}'], unit)} | "
                    f"{ratio(s[f'{measure}_hvdlite_torch_over_module'])}; {ratio(best)} | "
                    f"{ratio(s[f'{measure}_hvdlite_torch_over_mpi4py'])} | "
                    f"{ratio(s[f'{measure}_module_over_mpi4py'])} |")
    return "\n".join(rows) + "\n"


def more_tables(rss: list[dict[str, Any]], synth: list[dict[str, Any]]) -> str:
    """peak_rss's and synthetic_vs_horovod's summaries as Markdown tables."""
    out: list[str] = []
    machine = next((r for r in rss if r.get("kind") == "machine"), {})
    for summary in [r for r in rss if r.get("kind") == "summary"]:
        out += [f"**peak_rss**, zero_grad {summary.get('zero_grad', 'none')} ({machine.get('model')}, batch "
                f"{machine.get('batch')} x {machine.get('seq')} tokens "
                f"per rank, {machine.get('steps')} AdamW steps; median over {machine.get('repeats')} fresh runs of "
                f"the highest rank's ru_maxrss):\n", "| configuration | ranks | RSS after model MB | peak RSS MB | "
                "min-max MB |", "|---|---:|---:|---:|---|"]
        for name, r in summary["configs"].items():
            out.append(f"| {name} | {r['ranks']} | {r['rss_after_model_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
                       f"{r['peak_rss_mb_min']:.0f}-{r['peak_rss_mb_max']:.0f} |")
        ratios = [f"{key[5:]} {value:.3f}" for key, value in summary.items() if key.startswith("over_")]
        out += ["", f"{summary.get('subject')} / " + ", / ".join(ratios), ""] if ratios else [""]
    summary = next((r for r in synth if r.get("kind") == "summary"), None)
    if summary:
        out += [f"**synthetic_vs_horovod** ({summary['ranks']} ranks, {summary['rounds']} alternating launches "
                "each):\n", f"| hvdlite.torch img/s | {summary['peer_module']} img/s | ratio of medians | "
                "median per-round ratio | CPU s per launch (hvdlite / peer) |", "|---:|---:|---:|---:|---:|",
                f"| {summary['hvdlite_img_per_s']:.1f} | {summary['peer_img_per_s']:.1f} | "
                f"{summary['hvdlite_over_peer']:.2f} | {summary['median_round_ratio']:.2f} | "
                f"{summary.get('hvdlite_cpu_s', float('nan')):.1f} / "
                f"{summary.get('peer_cpu_s', float('nan')):.1f} |", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(HERE / "results"), help="folder with the JSON-line files")
    folder = Path(p.parse_args(argv).results)
    print(markdown_tables(load(folder / "grad_sync.json"), load(folder / "train_throughput.json"),
                          load(folder / "small_ops.json")))
    print(more_tables(load(folder / "peak_rss.json"), load(folder / "synthetic_vs_horovod.json")))


if __name__ == "__main__":
    main()
