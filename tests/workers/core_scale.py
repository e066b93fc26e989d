"""Many ranks (64, oversubscribed): a few hundred mixed collectives, every result exact."""
import numpy as np
from report import report

import hvdlite as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
tri = n * (n - 1) // 2
for i in range(300):
    k = i % 6
    if k == 0:  # steady-state names: the cached (bit-vector) path
        out = hvd.allreduce(np.arange(5, dtype=np.int64) + r, op=hvd.Sum, name=f"grad.{i % 12}")
        assert np.array_equal(out, np.arange(5) * n + tri), (i, out)
    elif k == 1:
        outs = hvd.grouped_allreduce([np.full(3, r, np.float32), np.full((2, 2), 1, np.int32)], op=hvd.Sum,
                                     name=f"group.{i % 12}")
        assert np.array_equal(outs[0], np.full(3, tri, np.float32)) and np.array_equal(outs[1], np.full((2, 2), n))
    elif k == 2:
        out = hvd.allgather(np.full((r % 3, 2), r, np.int16))
        want = np.concatenate([np.full((q % 3, 2), q, np.int16) for q in range(n)])
        assert np.array_equal(out, want), i
    elif k == 3:
        root = i % n
        out = hvd.broadcast(np.full(4, r, np.float64), root_rank=root, name=f"bcast.{i}")
        assert np.array_equal(out, np.full(4, root, np.float64)), i
    elif k == 4:
        out = hvd.reducescatter(np.ones((2 * n, 3), np.float32), op=hvd.Sum, name=f"rs.{i % 12}")
        assert np.array_equal(out, np.full((2, 3), n, np.float32)), i
    else:
        out, splits = hvd.alltoall(np.repeat(np.arange(n, dtype=np.int32), 1) * 0 + r, name=f"a2a.{i % 12}")
        assert np.array_equal(out, np.arange(n, dtype=np.int32)) and np.array_equal(splits, np.ones(n)), i
    if i % 50 == 49:
        hvd.barrier()
late = hvd.straggler_report()  # reduced to the 8 latest ranks' figures: the same dict on every rank
assert len(late["ranks"]) == 8 and late["windows"] >= 1 and len(set(map(repr, hvd.allgather_object(late)))) == 1, late
stats = hvd.engine_stats()
report(r, size=n, collectives=i + 1, cycles=stats["cycles"], full_cycles=stats["full_cycles"])
