"""A rank that is late by more than the stall time triggers a warning naming the tensor and the rank."""
import time

import numpy as np

import hvdlite as hvd
from _check import raises, same

hvd.init(stall_check_time_seconds=0.5, idle_heartbeat_seconds=0.1)
r, n = hvd.rank(), hvd.size()
if r == n - 1:
    time.sleep(2.0)
same(hvd.allreduce(np.ones(2), op=hvd.Sum, name="late.tensor"), np.full(2, float(n)), "late", r)
hvd.shutdown()

# with a stall shutdown time, the stalled op fails instead of hanging
hvd.init(stall_check_time_seconds=0.3, stall_shutdown_time_seconds=1.0, idle_heartbeat_seconds=0.1)
if r != n - 1:
    raises(hvd.StallError, lambda: hvd.allreduce(np.ones(2), name="never"), f"ranks [{n - 1}] never submitted")
else:
    time.sleep(2.0)  # past the others' stall shutdown, so only "never" stalls
hvd.barrier()
print(f"OK rank {r}")
