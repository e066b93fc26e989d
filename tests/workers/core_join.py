"""join() with uneven data: ranks that run out contribute zeros until everyone has joined."""
import numpy as np

import hvdlite as hvd
from _check import same

hvd.init()
r, n = hvd.rank(), hvd.size()
steps = r + 2  # rank r has r + 2 batches; the last rank has the most
for step in range(steps):
    got = hvd.allreduce(np.full(3, 1.0 + r), op=hvd.Sum, name="grad")
    active = [k for k in range(n) if k + 2 > step]
    same(got, np.full(3, sum(1.0 + k for k in active)), f"step {step}", r)
    avg = hvd.allreduce(np.full(2, 6.0), name="avg")  # Average divides by the full size
    same(avg, np.full(2, 6.0 * len(active) / n), f"average step {step}", r)
    gathered = hvd.allgather(np.full((1,), r), name="rows")
    same(gathered, np.array(active), f"allgather step {step}", r)
last = hvd.join()
assert last == n - 1, (last, n)
# after everyone joined, collectives work normally again
same(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after"), np.full(1, float(n)), "after join", r)
print(f"OK rank {r}")
