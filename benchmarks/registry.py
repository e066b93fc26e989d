"""The benchmarks ``python -m benchmarks`` runs: the ``headline`` suite (the figures of benchmarks/README.md), the
``gpu`` suite (the one prepared call of a machine with a GPU) and the ``soak`` (many failures in one elastic job).
A new benchmark is one ``Bench(...)`` here;
the one-question investigations live in benchmarks/lab/ (see its README) and are run by hand."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Bench:
    """One run of a script, whose output (JSON lines) goes to ``results/<name>.json``. In ``args`` and ``smoke``,
    ``{np}`` is the runner's --np, ``{root}`` this checkout and ``{ompi_python}`` the runner's --ompi-python (a
    Python whose mpi4py loads Open MPI 5; without one the run is skipped, saying so)."""
    name: str
    #: the question it answers, in one line
    question: str
    #: arguments of the default run
    args: tuple[str, ...] = ()
    #: arguments of the smoke run (tiny sizes, seconds: the figures mean nothing); None: not smoked
    smoke: Optional[tuple[str, ...]] = None
    suite: str = "headline"
    #: ranks of ``mpiexec -n``; 0: the runner's --np; None: the script starts its own jobs
    ranks: Optional[int] = 0
    #: how Horovod is measured with the runner's ``--horovod-venv VENV``: "module" (the venv's python and mpiexec
    #: run the script with ``--hvd-module horovod.torch``), "venv" (the script gets ``--horovod-venv VENV``),
    #: "required" (like "venv"; skipped without a venv), "" (no peer)
    peer: str = ""
    #: the script, relative to the repository (default: benchmarks/<name>.py)
    script: str = ""
    #: environment variables of the run, "NAME=VALUE"
    env: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return HERE.parent / (self.script or f"benchmarks/{self.name}.py")


_SYNC = ("--no-gloo", "--reps", "11", "--warmup", "2", "--chunk-mb", "1", "--methods", "mpi_nb_*,hvdlite_optimizer*")
_SYNC_SMOKE = ("--no-gloo", "--scale", "0.02", "--reps", "2", "--warmup", "1", "--chunk-mb", "1", "--methods",
               "mpi_nb_*,hvdlite_optimizer*")
_CHECK = "tests/gpu_check.py"
_PARTS = "benchmarks/lab/grad_sync_parts.py"

BENCHMARKS: tuple[Bench, ...] = (
    Bench("small_ops", "one tiny allreduce's latency, 1,000 small allreduces in flight, idle engine CPU: hvdlite "
          "against raw mpi4py and Horovod",
          smoke=("--iters", "20", "--reps", "2", "--inflight", "40", "--sessions", "1", "--idle-seconds", "0.3"),
          peer="module"),
    Bench("grad_sync", "ResNet-50's and BERT-base's gradient sync against the transport's limit (raw chunked "
          "Allreduce), per tensor, gloo and Horovod",
          smoke=("--scale", "0.0005", "--reps", "2", "--warmup", "1", "--hvd-module", "hvdlite.torch"), peer="module"),
    Bench("train_throughput", "torch training samples/s (ResNet-50, a transformer): hvdlite against one process, "
          "DDP, Horovod and the machine's own limit", smoke=("--tiny", "--steps", "2", "--rounds", "1", "--warmup",
          "1", "--models", "transformer", "--hvd-module", "hvdlite.torch"), peer="module"),
    Bench("synthetic_vs_horovod", "examples/pytorch_synthetic_benchmark.py's img/s with hvdlite.torch against "
          "Horovod, alternating launches", ("--np", "{np}"),
          ("--np", "{np}", "--rounds", "1", "--peer-module", "hvdlite.torch", "--", "--model", "resnet18",
           "--batch-size", "2", "--image-size", "32", "--num-classes", "10", "--num-warmup-batches", "1",
           "--num-batches-per-iter", "1", "--num-iters", "2"), ranks=None, peer="required"),
    Bench("peak_rss", "peak RSS per rank of a BERT-base AdamW step: hvdlite against plain torch, DDP, Horovod "
          "and another checkout", ("--np", "{np}", "--hvdlite-path", "{root}", "--zero-grad", "none,zeros"),
          ("--np", "{np}", "--hvdlite-path", "{root}", "--model", "tiny", "--steps", "1", "--repeats", "1"),
          ranks=None, peer="venv"),
    Bench("elastic_recovery", "time from a rank's kill -9 to the next completed step: in-process recovery (ULFM, "
          "Open MPI 5) against the restart path (MPICH)", ("--ompi-python", "{ompi_python}"), ranks=None),
    Bench("elastic_soak", "a hundred failures (kill -9 or SIGSTOP of a random rank every 5-15 s) in one elastic job "
          "under Open MPI 5: survived, recovery and regrowth times, steps lost (about 20 min; the CI version is "
          "tests/test_elastic_soak.py)", ("--ompi-python", "{ompi_python}"), suite="soak", ranks=None),
    # (tests/gpu_check.py's runs on CPU are tests/test_gpu_check.py's)
    Bench("gpu_check", "every collective on CUDA tensors through NCCL equals the MPI path's", suite="gpu", ranks=1,
          script=_CHECK),
    Bench("gpu_check_staged", "the same through host staging (HOROVOD_GPU_OPERATIONS=MPI)", suite="gpu", ranks=2,
          script=_CHECK, env=("HOROVOD_GPU_OPERATIONS=MPI",)),
    Bench("gpu_check_gloo", "the same through gloo (HOROVOD_GPU_OPERATIONS=GLOO)", suite="gpu", ranks=2,
          script=_CHECK, env=("HOROVOD_GPU_OPERATIONS=GLOO",)),
    Bench("gpu_check_nccl_missing", "NCCL missing on one rank: the error every rank reports", ("--nccl-missing",),
          suite="gpu", ranks=2, script=_CHECK),
    Bench("gpu_latency", "one GPU: a tiny CUDA allreduce's latency and 1,000 in flight against NCCL directly",
          smoke=("--dry-run-cpu", "--iters", "5", "--inflight", "20", "--rounds", "1"), suite="gpu", ranks=1),
    Bench("gpu_latency_no_stragglers", "the same without straggler attribution", suite="gpu", ranks=1,
          script="benchmarks/gpu_latency.py", env=("HVDLITE_STRAGGLER_WINDOW_OPS=0",)),
    Bench("gpu_latency_fast_cycle", "the same with a 0.1 ms cycle", suite="gpu", ranks=1,
          script="benchmarks/gpu_latency.py", env=("HOROVOD_CYCLE_TIME=0.1",)),
    Bench("grad_sync_n2", "gradient sync taken apart on CPU tensors: raw non-blocking loops against "
          "DistributedOptimizer", _SYNC, _SYNC_SMOKE, suite="gpu", ranks=2, script=_PARTS),
    Bench("grad_sync_n4", "the same at 4 ranks", _SYNC, _SYNC_SMOKE, suite="gpu", ranks=4, script=_PARTS),
)

BY_NAME = {bench.name: bench for bench in BENCHMARKS}
SUITES = {suite: tuple(b.name for b in BENCHMARKS if b.suite == suite) for suite in ("headline", "gpu", "soak")}
