"""Fault-injection worker: the test kills, stops or mis-configures one rank from outside.

Modes: ``loop`` (large allreduces until killed; each rank prints its pid first), ``env`` (fusion- and
chunk-sensitive collectives with exact checks, under per-rank environments), ``stall`` (small allreduces until
one rank is stopped; the others report what they got and when), ``stall_torch`` (the same with 16 MB torch
tensors: under HOROVOD_CPU_OPERATIONS=GLOO the others wait inside the gloo data plane), ``hang`` (the last rank
does one step fewer, then every rank averages a metric: a wait that never ends; each rank reports the share of a
core its process used from HANG_SETTLE_S to HANG_SETTLE_S + HANG_MEASURE_S after its first step, and exits).
"""
import os
import sys
import threading
import time

import numpy as np
from report import report

import hvdlite as hvd


def say(line: str) -> None:
    """One whole line per write: with PYTHONUNBUFFERED, print() writes the text and the newline separately,
    and the launcher may interleave two ranks' lines between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


mode = sys.argv[1]
if mode == "stall_torch":
    import torch
    import hvdlite.torch as hvd_torch  # before init(): it registers the torch.distributed planes
hvd.init()
r, n = hvd.rank(), hvd.size()
say(f"PID rank={r} pid={os.getpid()}")
hvd.allreduce(np.ones(1), name="warmup")

if mode == "loop":
    big = np.full(8 << 20, float(r + 1), dtype=np.float32)  # 32 MB: many chunks per allreduce
    want = float(sum(range(1, n + 1)))
    for step in range(100000):
        out = hvd.allreduce(big, op=hvd.Sum, name="big")
        assert out[0] == want and out[-1] == want, (step, out[0])
        if step == 0:
            say(f"LOOPING rank={r}")
elif mode == "env":
    wrong = []
    for step in range(20):
        shapes = [(3,), (100,), (1000,), (), (7, 5), (40000,)]
        handles = [hvd.allreduce_async(np.full(s, float(r + 1 + i + step), dtype=np.float32), op=hvd.Sum,
                                       name=f"t{i}") for i, s in enumerate(shapes)]
        for i, (s, h) in enumerate(zip(shapes, handles)):
            got = hvd.synchronize(h)
            want = np.full(s, float(sum(q + 1 + i + step for q in range(n))), dtype=np.float32)
            if not (got.shape == want.shape and np.array_equal(got, want)):
                wrong.append(f"step {step} allreduce t{i}: {got.tolist()} != {want.tolist()}")
        g = hvd.grouped_allreduce([np.arange(k, dtype=np.int64) * (r + 1) for k in (1, 50, 3000)], op=hvd.Sum,
                                  name="grouped")
        for k, a in zip((1, 50, 3000), g):
            if not np.array_equal(a, np.arange(k) * (n * (n + 1) // 2)):
                wrong.append(f"step {step} grouped allreduce of {k}: {a[:8].tolist()}...")
        b = hvd.broadcast(np.full(5000, r, dtype=np.int16), root_rank=n - 1, name="bc")
        if not np.array_equal(b, np.full(5000, n - 1, dtype=np.int16)):
            wrong.append(f"step {step} broadcast: {b[:8].tolist()}...")
    report(r, steps=step + 1, wrong=wrong)
elif mode in ("stall", "stall_torch"):
    say(f"LOOPING rank={r}")
    step = 0
    start = time.monotonic()
    try:
        while True:
            start = time.monotonic()
            if mode == "stall":
                hvd.allreduce(np.ones(4), name=f"s{step % 4}")
            else:
                hvd_torch.allreduce(torch.ones(4 << 20), name=f"s{step % 4}")
            step += 1
    except Exception as exc:  # noqa: BLE001 - report exactly what this rank got
        say(f"RESULT rank={r} after={time.monotonic() - start:.1f} {type(exc).__name__}: {exc}")
        # The first rank to exit ends the job (MPICH's launcher takes an exit without MPI_Finalize for a failed
        # job and ends the others): wait, so every survivor reports first; the test ends the job once they have.
        time.sleep(10)
        os._exit(0)
elif mode == "hang":
    settle, measure = float(os.environ["HANG_SETTLE_S"]), float(os.environ["HANG_MEASURE_S"])

    def cpu_share() -> None:
        time.sleep(settle)
        cpu, wall = time.process_time(), time.monotonic()  # every thread of this process: the engine's too
        time.sleep(measure)
        say(f"HANGCPU rank={r} share={(time.process_time() - cpu) / (time.monotonic() - wall):.5f}")
        time.sleep(4)  # the first rank to exit ends the job: every rank reports first
        os._exit(0)  # the wait never ends: the measurement ends the rank

    threading.Thread(target=cpu_share, daemon=True).start()  # the other ranks never get past the last step
    for step in range(20 - (r == n - 1)):
        hvd.allreduce(np.ones(1000), name=f"grad{step}")
    hvd.allreduce(np.ones(1), op=hvd.Average, name="metric")
    say(f"UNREACHABLE rank={r}")
