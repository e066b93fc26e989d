#!/usr/bin/env bash
# What a session lent the one-GPU machine (../shared/gpu/README.md) owes there, in one prepared call: every
# result lands under $OUT as it comes (6 files: fewer than the 8 that come back), NCCL's binary bytes included.
#
#   bash benchmarks/gpu_session.sh [checks] [sync] [latency]     (all three by default; about 7 minutes)
#
#   checks   tests/gpu_check.py at -n 1 (NCCL), -n 2 through host staging, through gloo, and with NCCL missing on
#            one rank (--nccl-missing), in parallel (~30 s): every collective on CUDA tensors equal to the MPI
#            path's, the accumulating compressions included; all four in gpu_check.txt
#   sync     issue 35's gradient sync taken apart on the machine's 16 cores (CPU tensors, its Open MPI):
#            grad_sync.py's raw non-blocking loops and DistributedOptimizer's sync (Average, Sum, predivide,
#            depths) at -n 2 and -n 4 (~4-5 min)
#   latency  benchmarks/gpu_latency.py at -n 1 (one blocking op and 1,000 in flight against NCCL direct), then
#            without straggler attribution and with a 0.1 ms cycle (what each costs per op) (~1-2 min)
#
# Here, without a GPU, `PY=python OUT=/tmp/gs QUICK=1 bash benchmarks/gpu_session.sh` checks that it runs (CPU
# tensors, shrunken runs).
set -u
PY="${PY:-/opt/torch/.venv/bin/python3}"
: "${OUT:?set OUT to the folder the results go to}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
parts="${*:-checks sync latency}"
log="$OUT/session.log"
sync_quick=() latency_quick=()
if [ -n "${QUICK:-}" ]; then
  sync_quick=(--scale 0.02 --reps 2 --warmup 1) latency_quick=(--rounds 1 --iters 20 --inflight 50)
fi

run() {  # run N SCRIPT ARGS...: under hvdlite's launcher, with the machine's interpreter on every rank
  local n="$1"; shift
  "$PY" -m hvdlite.run -np "$n" "$PY" "$@"
}
say() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$log"; }

for part in $parts; do
  case "$part" in
    checks)
      say "checks: gpu_check.py -n 1 (NCCL), -n 2 staged, -n 2 gloo, -n 2 --nccl-missing"
      tmp="$(mktemp -d)"
      run 1 tests/gpu_check.py > "$tmp/nccl" 2>&1 &
      HOROVOD_GPU_OPERATIONS=MPI run 2 tests/gpu_check.py > "$tmp/staged" 2>&1 &
      HOROVOD_GPU_OPERATIONS=GLOO run 2 tests/gpu_check.py > "$tmp/gloo" 2>&1 &
      run 2 tests/gpu_check.py --nccl-missing > "$tmp/nccl-missing" 2>&1 &
      wait
      for f in nccl staged gloo nccl-missing; do  # -a: NCCL's output holds bytes that make grep print only
        # "binary file matches"
        { echo "== $f"; cat "$tmp/$f"; } >> "$OUT/gpu_check.txt"
        say "gpu_check $f: $(grep -a -c '"failures": \[\]' "$tmp/$f") rank(s) without a failure"
      done
      rm -rf "$tmp"
      ;;
    sync)
      for n in 2 4; do
        say "sync: grad_sync.py -n $n"
        run "$n" benchmarks/grad_sync.py --no-gloo --reps 11 --warmup 2 --chunk-mb 1 "${sync_quick[@]}" \
          --methods "mpi_nb_*,hvdlite_optimizer*" --out "$OUT/grad_sync_n$n.json" >> "$log" 2>&1
        say "sync -n $n: exit $?"
      done
      ;;
    latency)
      say "latency: gpu_latency.py -n 1"
      run 1 benchmarks/gpu_latency.py "${latency_quick[@]}" --out "$OUT/gpu_latency_n1.json" >> "$log" 2>&1
      say "latency: exit $?"
      for variant in HVDLITE_STRAGGLER_WINDOW_OPS=0 HOROVOD_CYCLE_TIME=0.1; do
        echo "{\"variant\": \"$variant\"}" >> "$OUT/gpu_latency_variants.json"
        (export "$variant"; run 1 benchmarks/gpu_latency.py "${latency_quick[@]}") \
          >> "$OUT/gpu_latency_variants.json" 2>> "$log"
        say "latency $variant: exit $?"
      done
      ;;
    *)
      say "unknown part $part (checks, sync, latency)"; exit 2 ;;
  esac
done
