#!/usr/bin/env bash
# Regenerates every figure of benchmarks/README.md in one run, with Horovod measured alongside when its venv is given.
#
# Usage: benchmarks/run_all.sh [--smoke] [--np N] [--results DIR] [--rss-baseline DIR] [HOROVOD_VENV]
#   HOROVOD_VENV  a virtualenv with Horovod (build: ../shared/peers/build-horovod.sh VENV, then
#                 VENV/bin/pip install --no-deps -e .). The torch benchmarks (small_ops, grad_sync,
#                 train_throughput --frameworks torch) then run with VENV/bin/python and VENV/bin/mpiexec and
#                 --hvd-module horovod.torch; hvdlite comes from this checkout through PYTHONPATH. Without it,
#                 Horovod is skipped with a message and the system Python runs everything.
#   The Keras part of train_throughput always runs with the system Python ($PYTHON, default python3): the
#   Horovod venv has no TensorFlow.
#   --smoke       tiny sizes (seconds, for checking the script; the figures mean nothing)
#   --np N        ranks (default 2)   --results DIR   where the JSON lines go (default benchmarks/results)
#   --rss-baseline DIR   another checkout (e.g. a git worktree of an older commit) whose hvdlite peak_rss.py
#                 measures beside this one's, as "before"
# Writes DIR/small_ops.json, grad_sync.json, hw_scaling.json, train_throughput.json (torch then Keras lines),
# peak_rss.json, synthetic_vs_horovod.json (with HOROVOD_VENV only), benchmarks.png, and prints the
# README's Markdown tables (plot.py --tables).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
RESULTS="$HERE/results"
NP=2
SMOKE=0
VENV=""
RSS_BASE=()
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) SMOKE=1 ;;
        --np) NP="$2"; shift ;;
        --results) RESULTS="$2"; shift ;;
        --rss-baseline) RSS_BASE=(--hvdlite-path "before=$2"); shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        -*) echo "run_all.sh: unknown option $1" >&2; exit 2 ;;
        *) VENV="$1" ;;
    esac
    shift
done

SYS_PY="${PYTHON:-python3}"
SYS_MPIEXEC="$(command -v mpiexec || true)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
LIMIT=3600  # seconds allowed per benchmark

if [ -n "$VENV" ]; then
    VENV="$(cd "$VENV" && pwd)"
    TORCH_PY="$VENV/bin/python"
    TORCH_MPIEXEC="$VENV/bin/mpiexec"
    for f in "$TORCH_PY" "$TORCH_MPIEXEC"; do
        [ -x "$f" ] || { echo "run_all.sh: $f is missing: is $VENV a Horovod venv?" >&2; exit 2; }
    done
    if ! "$TORCH_PY" -c "import horovod.torch" 2>/dev/null; then
        echo "run_all.sh: $TORCH_PY cannot import horovod.torch: build it with ../shared/peers/build-horovod.sh $VENV" >&2
        exit 2
    fi
    MODULE=(--hvd-module horovod.torch)
    echo "run_all.sh: Horovod from $VENV ($("$TORCH_PY" -c 'import horovod; print(horovod.__version__)'))," \
         "hvdlite from $ROOT" >&2
else
    TORCH_PY="$SYS_PY"
    TORCH_MPIEXEC="$SYS_MPIEXEC"
    MODULE=()
    echo "run_all.sh: no Horovod venv given: skipping Horovod (pass HOROVOD_VENV to measure it in the same run)" >&2
fi
[ -n "$TORCH_MPIEXEC" ] || { echo "run_all.sh: no mpiexec on PATH" >&2; exit 2; }

if [ "$SMOKE" = 1 ]; then
    SMALL=(--iters 20 --reps 2 --inflight 40 --sessions 1 --idle-seconds 0.3)
    GRAD=(--scale 0.0005 --reps 2 --warmup 1)
    TRAIN=(--tiny --steps 2 --rounds 1 --warmup 1 --keras-models transformer)
    HW=(--tiny --steps 1 --rounds 1)
    RSS=(--model tiny --steps 1 --repeats 1)
    SYNTH=(--rounds 1 -- --model resnet18 --batch-size 2 --image-size 32 --num-warmup-batches 1
           --num-batches-per-iter 1 --num-iters 1)
    LIMIT=600
else
    SMALL=() GRAD=() TRAIN=() HW=() RSS=(--zero-grad none,zeros) SYNTH=()
fi

mkdir -p "$RESULTS"
cd "$ROOT"
step() { echo "run_all.sh: $*" >&2; }

step "small_ops ($NP ranks)"
timeout "$LIMIT" "$TORCH_MPIEXEC" -n "$NP" "$TORCH_PY" benchmarks/small_ops.py "${SMALL[@]}" "${MODULE[@]}" \
    --out "$RESULTS/small_ops.json" > /dev/null
step "grad_sync ($NP ranks)"
timeout "$LIMIT" "$TORCH_MPIEXEC" -n "$NP" "$TORCH_PY" benchmarks/grad_sync.py "${GRAD[@]}" "${MODULE[@]}" \
    --out "$RESULTS/grad_sync.json" > /dev/null
step "hw_scaling ($NP ranks)"
timeout "$LIMIT" "$TORCH_MPIEXEC" -n "$NP" "$TORCH_PY" benchmarks/hw_scaling.py "${HW[@]}" \
    --out "$RESULTS/hw_scaling.json" > /dev/null
step "train_throughput, torch"
timeout "$LIMIT" "$TORCH_PY" benchmarks/train_throughput.py --np "$NP" --frameworks torch "${TRAIN[@]}" \
    "${MODULE[@]}" --timeout "$LIMIT" --out "$RESULTS/train_throughput.torch.json" > /dev/null
step "train_throughput, keras (system Python: $SYS_PY)"
timeout "$LIMIT" "$SYS_PY" benchmarks/train_throughput.py --np "$NP" --frameworks keras "${TRAIN[@]}" \
    --timeout "$LIMIT" --out "$RESULTS/train_throughput.keras.json" > /dev/null
cat "$RESULTS/train_throughput.torch.json" "$RESULTS/train_throughput.keras.json" > "$RESULTS/train_throughput.json"
rm -f "$RESULTS/train_throughput.torch.json" "$RESULTS/train_throughput.keras.json"

step "peak_rss ($NP ranks; a fresh job per configuration)"
timeout "$LIMIT" "$SYS_PY" benchmarks/peak_rss.py --np "$NP" --hvdlite-path "$ROOT" "${RSS_BASE[@]}" \
    ${VENV:+--horovod-venv "$VENV"} "${RSS[@]}" --timeout "$LIMIT" --out "$RESULTS/peak_rss.json" > /dev/null
rm -f "$RESULTS/synthetic_vs_horovod.json"
if [ -n "$VENV" ]; then
    step "synthetic_vs_horovod ($NP ranks, alternating launches)"
    timeout "$LIMIT" "$SYS_PY" benchmarks/synthetic_vs_horovod.py --np "$NP" --horovod-venv "$VENV" \
        --out "$RESULTS/synthetic_vs_horovod.json" "${SYNTH[@]}" > /dev/null
else
    step "synthetic_vs_horovod skipped: it compares with Horovod (pass HOROVOD_VENV)"
fi

step "plot"
"$SYS_PY" benchmarks/plot.py --results "$RESULTS" >&2
"$SYS_PY" benchmarks/plot.py --results "$RESULTS" --tables
