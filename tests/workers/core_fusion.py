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
