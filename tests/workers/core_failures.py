"""Failure modes: a rank that raises, dies, or shuts down early must end or fail the job promptly."""
import os
import sys
import time

import numpy as np
from report import report

import hvdlite as hvd

mode = sys.argv[1]
hvd.init()
r, n = hvd.rank(), hvd.size()
hvd.allreduce(np.ones(1), name="warmup")
if mode == "raise":
    if r == 1:
        raise ValueError("the real error on rank 1: bad batch 17")
    time.sleep(0.5)
    hvd.allreduce(np.ones(1), name="waits.forever")
elif mode == "thread_raise":
    if r == 1:
        import threading

        def load_batches() -> None:
            raise ValueError("the real error in rank 1's loader thread: bad batch 17")

        threading.Thread(target=load_batches, name="loader").start()
    hvd.allreduce(np.ones(1), name="waits.forever")  # rank 1's main thread waits too, for nobody
elif mode == "die":
    if r == 1:
        os._exit(3)
    hvd.allreduce(np.ones(1), name="waits.forever")
elif mode == "early_exit":
    if r == 1:
        sys.exit(0)  # a clean exit: its atexit shutdown tells the others
    try:
        hvd.allreduce(np.ones(1), name="waits.forever")
    except hvd.ShutdownError as exc:
        try:
            hvd.allreduce(np.ones(1), name="later")
        except hvd.ShutdownError as later:
            report(r, error=str(exc), later_error=type(later).__name__)
            sys.exit(0)
    sys.exit(5)
