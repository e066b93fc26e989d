"""Regenerate the benchmark plot (one PNG comparing the methods) and the README tables from the JSON output.

Run: python benchmarks/plot.py [--results benchmarks/results] [--out benchmarks/results/benchmarks.png]
     python benchmarks/plot.py --tables      # print the README's Markdown tables instead
Reads grad_sync.json, train_throughput(_keras).json and small_ops.json from --results (any may be missing); the
tables also peak_rss.json and synthetic_vs_horovod.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COLORS = {"a": "#7f7f7f", "b": "#bcbd22", "c": "#1f77b4", "d": "#d62728", "e": "#ff7f0e", "f": "#9467bd",
          "g": "#2ca02c", "diag": "#c7c7c7"}


def load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def results(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "method" in r]


def plot_grad_sync(ax: Any, records: list[dict[str, Any]], model: str) -> None:
    rows = [r for r in results(records) if r.get("model") == model]
    if not rows:
        ax.set_visible(False)
        return
    rows.sort(key=lambda r: r["ms"])
    names = [f"({r['group']}) {r['method']}" for r in rows]
    bars = ax.barh(names, [r["ms"] for r in rows], color=[COLORS.get(r["group"], "#333333") for r in rows])
    for bar, r in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['ratio']:.2f}x", va="center",
                fontsize=7)
    ax.invert_yaxis()
    mb = rows[0]["bytes"] / 1e6
    ax.set_title(f"grad_sync {model}: {rows[0]['tensors']} tensors, {mb:.0f} MB, {rows[0]['ranks']} ranks\n"
                 f"median ms (label: ratio to the fastest raw MPI flat Allreduce)", fontsize=9)
    ax.set_xlabel("milliseconds (lower is better)")
    ax.tick_params(axis="y", labelsize=7)


def plot_train(ax: Any, records: list[dict[str, Any]]) -> None:
    rows = results(records)
    if not rows:
        ax.set_visible(False)
        return
    groups = sorted({(r["framework"], r["model"]) for r in rows})
    methods = []
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
    width = 0.8 / max(1, len(methods))
    palette = {"single": "#7f7f7f", "independent": "#c7c7c7", "hvdlite": "#d62728", "ddp": "#1f77b4",
               "hvd_module": "#9467bd"}
    for j, method in enumerate(methods):
        xs, ys, labels = [], [], []
        for i, key in enumerate(groups):
            match = [r for r in rows if (r["framework"], r["model"]) == key and r["method"] == method]
            if match:
                xs.append(i + j * width)
                ys.append(match[0]["samples_per_s"])
                eff = match[0].get("scaling_efficiency")
                labels.append(f"{eff:.2f}" if eff is not None else "")
        bars = ax.bar(xs, ys, width, label=method, color=palette.get(method))
        for bar, label in zip(bars, labels):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{fw}\n{model}" for fw, model in groups], fontsize=8)
    ax.set_ylabel("samples/s, all ranks (higher is better)")
    ax.set_title("train_throughput (label: scaling efficiency)", fontsize=9)
    ax.legend(fontsize=7)


def plot_small(ax: Any, records: list[dict[str, Any]]) -> None:
    rows = {r["method"]: r for r in results(records)}
    if not rows:
        ax.set_visible(False)
        return
    labels, values, colors = [], [], []
    for key, color in (("latency_mpi4py", "#7f7f7f"), ("latency_mpi4py_pickle", "#bcbd22"),
                       ("latency_hvdlite", "#d62728"), ("latency_hvdlite_torch", "#ff9896"),
                       ("latency_module", "#9467bd")):
        if key in rows:
            module = f" [{rows[key]['module']}]" if "module" in rows[key] else ""
            labels.append(key.replace("latency_", "latency: ") + module + " (us)")
            values.append(rows[key]["us"])
            colors.append(color)
    for key, color in (("inflight_mpi_loop", "#7f7f7f"), ("inflight_unfused", "#ff7f0e"),
                       ("inflight_fused", "#d62728"), ("inflight_hvdlite_torch", "#ff9896"),
                       ("inflight_module", "#9467bd")):
        if key in rows:
            module = f" [{rows[key]['module']}]" if "module" in rows[key] else ""
            labels.append(f"{rows[key]['count']} in flight: {key.replace('inflight_', '')}{module} (us per op)")
            values.append(rows[key]["ms"] * 1e3 / rows[key]["count"])
            colors.append(color)
    bars = ax.barh(labels, values, color=colors)
    for bar, value in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.1f}", va="center", fontsize=7)
    ax.set_xscale("log")
    ax.invert_yaxis()
    idle = [r for r in results(records) if r["method"] == "idle_cpu_hvdlite"]
    extra = f"; idle engine CPU {max(r['cpu_percent'] for r in idle):.2f}% of a core" if idle else ""
    ax.set_title(f"small_ops: microseconds (log scale, lower is better){extra}", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)


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
    p.add_argument("--out", default="", help="PNG path (default: RESULTS/benchmarks.png)")
    p.add_argument("--tables", action="store_true", help="print Markdown tables instead of drawing")
    args = p.parse_args(argv)
    folder = Path(args.results)
    train = load(folder / "train_throughput.json") + load(folder / "train_throughput_keras.json")
    if args.tables:
        print(markdown_tables(load(folder / "grad_sync.json"), train, load(folder / "small_ops.json")))
        print(more_tables(load(folder / "peak_rss.json"), load(folder / "synthetic_vs_horovod.json")))
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grad = load(folder / "grad_sync.json")
    small = load(folder / "small_ops.json")
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    plot_grad_sync(axes[0][0], grad, "resnet50")
    plot_grad_sync(axes[0][1], grad, "bert-base")
    plot_train(axes[1][0], train)
    plot_small(axes[1][1], small)
    machine = next((r for r in grad + train + small if r.get("kind") == "machine"), {})
    fig.suptitle(f"hvdlite benchmarks: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
                 f"{' '.join(str(machine.get('mpi', '?')).split())}, {machine.get('date', '')}", fontsize=10)
    fig.tight_layout()
    out = Path(args.out) if args.out else folder / "benchmarks.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
