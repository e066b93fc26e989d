"""Many small tensors complete in fewer MPI calls with fusion on; the timeline shows fusion phases."""
import json
import sys

import numpy as np

import hvdlite as hvd
from _check import same

timeline = sys.argv[1]
fusion = int(sys.argv[2])
hvd.init(fusion_threshold=fusion, cycle_time=20.0)  # a long cycle lets all 200 ops arrive first
r, n = hvd.rank(), hvd.size()
hvd.start_timeline(timeline, mark_cycles=True)
before = hvd.engine_stats()["mpi_calls"]
handles = [hvd.allreduce_async(np.full(10, float(i + r), np.float32), name=f"small.{i}", op=hvd.Sum)
           for i in range(200)]
for i, h in enumerate(handles):
    same(hvd.synchronize(h), np.full(10, float(i * n + sum(range(n))), np.float32), f"small.{i}", r)
calls = hvd.engine_stats()["mpi_calls"] - before
hvd.stop_timeline()
print(f"rank {r} mpi_calls {calls}")

# allgather and reducescatter fuse as well
before = hvd.engine_stats()["mpi_calls"]
gathers = [hvd.allgather_async(np.full((r + 1, 2), i, np.int32), name=f"ag.{i}") for i in range(50)]
scatters = [hvd.reducescatter_async(np.full((2 * n + 1, 3), float(i)), name=f"rs.{i}", op=hvd.Sum)
            for i in range(50)]
for i, h in enumerate(gathers):
    same(hvd.synchronize(h), np.concatenate([np.full((k + 1, 2), i, np.int32) for k in range(n)]), f"ag.{i}", r)
rows = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
for i, h in enumerate(scatters):
    same(hvd.synchronize(h), np.full((rows, 3), float(i * n)), f"rs.{i}", r)
other_calls = hvd.engine_stats()["mpi_calls"] - before
print(f"rank {r} allgather+reducescatter mpi_calls {other_calls}")
if fusion:
    assert other_calls < 20, f"100 small allgathers/reducescatters took {other_calls} MPI calls with fusion on"
else:
    assert other_calls >= 100, other_calls
if fusion:
    assert calls < 20, f"200 small tensors took {calls} MPI calls with fusion on"
else:
    assert calls == 200, f"fusion off must make one MPI call per tensor, made {calls}"
if r == 0:
    events = json.load(open(timeline))
    phases = {e.get("name") for e in events}
    rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {f"small.{i}" for i in range(200)} <= rows, "every tensor has a timeline row"
    assert {"NEGOTIATE", "QUEUE", "MPI_ALLREDUCE"} <= phases, phases
    assert "CYCLE_START" in phases, phases
    if fusion:
        assert {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"} <= phases, phases
    begins = sum(e.get("ph") == "B" for e in events)
    ends = sum(e.get("ph") == "E" for e in events)
    assert begins == ends, (begins, ends)
print(f"OK rank {r}")
