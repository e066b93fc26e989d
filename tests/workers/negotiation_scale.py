"""Many ranks (64, oversubscribed): the vote and its explaining round, every result and error exact; each rank
reports the engine's counters so the test can see what took which path."""
import logging
import random
import time

import numpy as np
from report import report

import hvdlite as hvd
from hvdlite.core.log import logger

hvd.init(stall_check_time_seconds=1.0, stall_shutdown_time_seconds=0, idle_heartbeat_seconds=0.05)
r, n = hvd.rank(), hvd.size()
tri = n * (n - 1) // 2
warnings: list[str] = []


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        warnings.append(record.getMessage())


logger.addHandler(Keep())
checks = []

# every submission order: 24 new names, each rank its own order, then the same names again (cached)
names = [f"order.{i}" for i in range(24)]
random.Random(r).shuffle(names)
before = hvd.engine_stats()
for step in range(2):
    handles = {name: hvd.allreduce_async(np.full(2, r + int(name[6:]), np.int64), op=hvd.Sum, name=name)
               for name in names}
    for name, handle in handles.items():
        assert np.array_equal(hvd.synchronize(handle), np.full(2, tri + n * int(name[6:]))), name
after = hvd.engine_stats()
checks.append("orders")
voted_explains = after["explain_cycles"] - before["explain_cycles"]

# unnamed ops of a loop: agreed by position after the first
for step in range(6):
    assert hvd.allreduce(np.array([r + step], np.int64), op=hvd.Sum)[0] == tri + n * step
checks.append("unnamed")

# a mismatch on one rank: every rank raises the same error naming the field and the rank
try:
    hvd.allreduce(np.ones(3 if r == n - 1 else 2, np.float32), name="mismatch")
    raise AssertionError("no mismatch error")
except hvd.TensorMismatchError as exc:
    text = str(exc).split(": ", 1)[1]
    assert "the shape differs across ranks (ranks 0, 1, 2" in text and f"rank {n - 1}: (3,))" in text, text
checks.append("mismatch")

# a stall: the last rank submits late; rank 0 warns naming it, and the op completes exactly
if r == n - 1:
    time.sleep(2.5)
assert hvd.allreduce(np.array([r], np.int64), op=hvd.Sum, name="late")[0] == tri
if r == 0:
    assert any("late" in w and f"missing ranks [{n - 1}]" in w for w in warnings), warnings
checks.append("stall")

# process sets: the even ranks and the odd ones (the odd set's proposer is rank 1), named and unnamed ops
evens, odds = hvd.add_process_set(list(range(0, n, 2))), hvd.add_process_set(list(range(1, n, 2)))
mine = evens if r % 2 == 0 else odds
members = list(range(r % 2, n, 2))
for step in range(3):
    got = hvd.allreduce(np.array([r], np.int64), op=hvd.Sum, name="set.grad", process_set=mine)
    assert got[0] == sum(members), got
    got = hvd.allreduce(np.array([step], np.int64), op=hvd.Sum, process_set=mine)
    assert got[0] == step * len(members), got
hvd.remove_process_set(evens)
hvd.remove_process_set(odds)
checks.append("process sets")

# join: rank r has r % 4 + 1 batches
for step in range(r % 4 + 1):
    active = sum(1 for q in range(n) if q % 4 + 1 > step)
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, name="join.grad")[0] == active
last = hvd.join()
assert last in [q for q in range(n) if q % 4 == 3], last
checks.append("join")

stats = hvd.engine_stats()
report(r, size=n, checks=checks, voted_explains=voted_explains, vote_bytes=after["vote_bytes"] - before["vote_bytes"],
       full_path_bytes=after["full_path_bytes"] - before["full_path_bytes"], cycles=stats["cycles"])
hvd.shutdown()
