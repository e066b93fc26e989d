"""Every measuring script of benchmarks/: how it launches, its default and smoke arguments, the question it
answers and how long it takes. ``python -m benchmarks`` runs from this table; tests/test_benchmarks.py smokes
every entry of it (or reads the reason it cannot be smoked in seconds). A new benchmark is one ``Bench(...)``
line in ``BENCHMARKS``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
#: Files of benchmarks/ that measure nothing themselves (helpers, the worker of train_throughput, the plot,
#: this table and the entry point).
NOT_BENCHMARKS = frozenset({"__init__", "__main__", "_common", "registry", "shapes", "plot", "train_keras"})


@dataclasses.dataclass(frozen=True)
class Bench:
    """One measuring script, ``benchmarks/<name>.py``, whose JSON lines go to ``results/<name>.json``."""
    name: str
    #: the question it answers, in one line
    question: str
    #: "mpi": ``mpiexec -n NP python <script>``; "python": the script starts its own jobs (``--np NP``, where
    #: it takes the flag: see takes_np)
    launch: str
    #: how long its default run takes on the 2-core machine, and where the figure comes from
    takes: str
    #: the arguments of its smoke run (tiny sizes, seconds: the figures mean nothing; hvdlite.torch stands in
    #: for Horovod's module, and gives way to it with --horovod-venv); None: see no_smoke
    smoke: Optional[tuple[str, ...]]
    #: why it has no smoke run (tests/test_benchmarks.py requires one of smoke and no_smoke)
    no_smoke: str = ""
    #: arguments of its default run (besides the runner's own)
    args: tuple[str, ...] = ()
    #: how the Horovod peer is measured with ``--horovod-venv VENV``: "module" (the venv's python and mpiexec,
    #: ``--hvd-module horovod.torch``), "venv" (the script takes ``--horovod-venv VENV``), "required" (like
    #: "venv", and the default run is skipped without a venv: it only compares with Horovod), "" (no peer)
    peer: str = ""
    #: in the ``headline`` suite: the figures at the top of benchmarks/README.md
    headline: bool = False
    #: ranks, where the script needs a given number (default: the runner's --np)
    ranks: Optional[int] = None
    #: what it prints on stdout: "jsonl" (one JSON object per line), "json" (one object), "text"
    output: str = "jsonl"
    #: whether it takes ``--out FILE`` (it then writes there what it prints); otherwise its stdout is kept
    takes_out: bool = True
    #: a "python" script that takes ``--np`` (the others size their jobs with their own flags)
    takes_np: bool = True
    #: it runs jobs under Open MPI 5 (ULFM): the runner's ``--ompi-python PY`` (a Python whose mpi4py loads pip's
    #: Open MPI 5) is handed on to it; without one it is skipped with a message
    ompi: bool = False

    @property
    def script(self) -> Path:
        return HERE / f"{self.name}.py"


BENCHMARKS: tuple[Bench, ...] = (
    Bench("small_ops", "one tiny allreduce's latency, 1,000 small allreduces in flight, idle engine CPU: hvdlite "
          "against raw mpi4py and Horovod", "mpi", "~20 s (README)",
          ("--iters", "20", "--reps", "2", "--inflight", "40", "--sessions", "1", "--idle-seconds", "0.3"),
          peer="module", headline=True),
    Bench("grad_sync", "ResNet-50's and BERT-base's gradient sync against the transport's limit (raw chunked "
          "Allreduce), per tensor, gloo and Horovod", "mpi", "~4 min (README)",
          ("--scale", "0.0005", "--reps", "2", "--warmup", "1", "--hvd-module", "hvdlite.torch"), peer="module",
          headline=True),
    Bench("hw_scaling", "the machine's own scaling limit: N independent trainings at once against one alone",
          "mpi", "~1 min (README)", ("--tiny", "--steps", "1", "--rounds", "1"), headline=True),
    Bench("train_throughput", "training samples/s (torch ResNet-50 and transformer, Keras): hvdlite against "
          "single, DDP, Horovod and the machine's own limit", "python", "~3 min (README)",
          ("--tiny", "--steps", "2", "--rounds", "1", "--warmup", "1", "--models", "transformer",
           "--hvd-module", "hvdlite.torch"), peer="module", headline=True),
    Bench("peak_rss", "peak RSS per rank of a BERT-base AdamW step: hvdlite against plain torch, DDP, Horovod "
          "and another checkout", "python", "~10 min idle (README; 20 fresh jobs)",
          ("--model", "tiny", "--steps", "1", "--repeats", "1"), args=("--zero-grad", "none,zeros"),
          peer="venv", headline=True),
    Bench("synthetic_vs_horovod", "examples/pytorch_synthetic_benchmark.py's img/s with hvdlite.torch against "
          "Horovod, alternating launches", "python", "~3 min idle (README)",
          ("--rounds", "1", "--peer-module", "hvdlite.torch", "--", "--model", "resnet18", "--batch-size", "2",
           "--image-size", "32", "--num-classes", "10", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
           "--num-iters", "2"), peer="required", headline=True),
    Bench("latency_breakdown", "where one small synchronous allreduce's time goes (timestamps inside the "
          "engine)", "mpi", "~5 s (README)", ("--ops", "20")),
    Bench("peer_wait", "what ranks waiting in an allreduce cost a rank still computing: hvdlite against waiting "
          "outside any library and Horovod", "mpi", "~40 s (estimate: 5 rounds of 2 ways of ~1-2 s, twice with "
          "Horovod)", ("--work", "20000", "--rounds", "1", "--hvd-module", "hvdlite.torch"), peer="module"),
    Bench("autotune", "autotune from deliberately bad settings against hand-set configurations (ResNet-50's "
          "gradients)", "mpi", "~5 min (estimate: 3 rounds x 5 configurations and up to 400 tuning steps)",
          ("--scale", "0.0005", "--reps", "1", "--rounds", "1", "--warmup-samples", "0", "--steps-per-sample",
           "2", "--max-samples", "3")),
    Bench("diagnostics", "the cost of straggler attribution, deterministic reductions, the call-site check and "
          "check_replicas", "mpi", "~5 min (estimate: 3 sessions per setting, ResNet-50 at 224x224)",
          ("--reps", "1", "--sessions", "1", "--inflight", "20", "--scale", "0.001", "--batch", "1", "--image",
           "32")),
    Bench("gloo_vs_mpi", "hvdlite's two data planes for torch CPU tensors (MPI engine against torch's gloo) on "
          "ResNet-50's gradients", "mpi", "~1 min (estimate: 3 rounds x 10 reps of 102 MB)",
          ("--scale", "0.001", "--reps", "1", "--rounds", "1"), takes_out=False),
    Bench("gpu_overhead", "one GPU: a ResNet-50 step with DistributedOptimizer at -n 1 against plain torch "
          "(without CUDA: a tiny CPU run)", "mpi", "~2 min on an H100 (estimate)", ("--rounds", "1"), ranks=1,
          takes_out=False),
    Bench("powersgd_bytes", "bytes per step powerSGD_hook hands to allreduce against uncompressed averaging",
          "mpi", "~1 min (README)", ("--model", "small-transformer", "--steps", "1", "--ranks", "1,2")),
    Bench("zero_memory", "optimizer-state bytes and peak RSS per rank: ZeroRedundancyOptimizer against "
          "DistributedOptimizer at 1, 2, 4 ranks", "python", "~3 min (README)",
          ("--ranks", "1,2", "--scale", "0.001", "--steps", "1", "--timeout", "240"), takes_np=False),
    Bench("zero_throughput", "training samples/s: hvdlite's ZeroRedundancyOptimizer against its "
          "DistributedOptimizer and torch's ZeroRedundancyOptimizer", "mpi", "~2 min (README)",
          ("--rounds", "1", "--steps", "1", "--warmup", "0", "--batch-size", "2", "--seq", "8")),
    Bench("negotiation_scale", "negotiation bytes per cycle (full and cached rounds) and cycle time against job "
          "size, 2 to 64 ranks", "python", "~5 min (estimate: one oversubscribed job per size)",
          ("--sizes", "2", "--tensors", "2", "--steps", "3"), output="json", takes_out=False,
          takes_np=False),
    Bench("profile_step", "where a training step's time goes: phases and CPU per thread, hvdlite against DDP "
          "and no overlap", "mpi", "~1 min (estimate: 8 steps per method)",
          ("--model", "transformer", "--batch", "2", "--rounds", "1")),
    Bench("bf16_accumulation", "the averaged gradient's error against fp64 at 2-64 ranks, bytes and time: fp32, "
          "bf16 reduced in bf16 (Horovod's way) and bf16 on the wire with fp32 accumulation", "python",
          "~6.5 min (session 8, loaded machine)", ("--smoke",), takes_np=False),
    Bench("gpu_latency", "one GPU: a tiny CUDA allreduce's latency and 1,000 in flight through hvdlite.torch "
          "against torch.distributed's NCCL directly, and host staging (says \"no CUDA device\" without one)",
          "mpi", "~1 min (estimate; never run on a GPU yet)",
          ("--dry-run-cpu", "--iters", "5", "--inflight", "20", "--rounds", "1"), ranks=1),
    Bench("elastic_recovery", "time from a rank's kill -9 to the next completed step: in-process recovery (ULFM, "
          "Open MPI 5) against the restart path (MPICH), detection time, steady-state cost: ulfm_cost",
          "python", "~20 min (session 8, loaded machine)", None,
          no_smoke="needs a venv whose mpi4py loads pip's Open MPI 5 (--ompi-python; the tests' ompi_python "
                   "fixture makes one) and kills ranks: every path it times runs in tests/test_elastic_inprocess.py",
          takes_out=False, takes_np=False, ompi=True),
    Bench("elastic_growth", "time from discovery adding a host to the first step that uses it: the restart path "
          "(what hvdlite does, also in in-process mode) against Open MPI 5's Comm.Spawn + Merge, and whether a "
          "Spawn-grown ULFM job still recovers from the loss of one of its first ranks",
          "python", "~5 min a round (session 10, loaded machine)", None,
          no_smoke="needs a venv whose mpi4py loads pip's Open MPI 5 (--ompi-python; the tests' ompi_python "
                   "fixture makes one), restarts a torch job and waits out each hung Spawn job (90 s): "
                   "the restart path it times runs in tests/test_elastic_hosts.py",
          takes_out=False, takes_np=False, ompi=True),
    Bench("ulfm_cost", "steady-state cost of Open MPI 5's fault tolerance (in-process elastic mode's flags: ULFM, "
          "the failure detector; also over TCP) against plain mpiexec (shared memory) and TCP alone: step-time "
          "ratios in one run, and what the mode adds to each call (--latency-rounds)", "python",
          "~8 min at --rounds 3 (loaded machine, 2026-11-26)",
          # (the smoke at one rank, after the runner's --np: each launch imports torch, ~25 s on the loaded machine)
          ("--rounds", "1", "--epochs", "1", "--samples", "24", "--width", "16", "--variants", "shm,ulfm", "--np",
           "1", "--latency-rounds", "1", "--calls", "200"), takes_out=True, ompi=True),
    Bench("keras_reduce", "where Keras' gradient reduction time goes (ResNet-50's 214 gradients), method by "
          "method", "mpi", "~1 min (README, with --fit)", None,
          no_smoke="measured (session 7): 53 s at -n 2 for one round, 18 s with one method, 9-10 s of it "
                   "importing TensorFlow; it builds Keras' ResNet-50 and has no size flag, and prints text, not "
                   "JSON lines: a smoke run needs a size flag and a JSON mode first", output="text",
          takes_out=False),
    Bench("autograph_trace", "a Keras custom loop's first call (AutoGraph, trace, one step) with hvdlite's tape and "
          "optimizer, against plain TensorFlow and against AutoGraph converting hvdlite", "python",
          "~1 min (estimate: 25 fresh processes of ~2-3 s)",
          ("--rounds", "1", "--steps", "1", "--methods", "optimizer_converted"), takes_np=False),
)

BY_NAME = {bench.name: bench for bench in BENCHMARKS}
SUITES = {"headline": tuple(b.name for b in BENCHMARKS if b.headline), "all": tuple(BY_NAME)}
