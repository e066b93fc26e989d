"""In-process recovery with process sets (tests/test_elastic_inprocess.py), on numpy only: at -n 4 the sets
[0, 1], [2, 3] and [3] are registered; rank 3 kills itself with SIGKILL at step 10. Every step checks a global
allreduce (= the job's size) and one allreduce per set this rank is in (= the set's size). Each survivor
prints ``final orig=R rank=r size=s pid=P step=N total=T sets=...`` (each set's id and ranks after recovery)."""
import os
import signal

import numpy as np

import hvdlite as hvd
from report import report

hvd.init()
orig = hvd.rank()
print(f"start orig={orig} pid={os.getpid()}", flush=True)
report(orig, start={"pid": os.getpid()})
sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3]), hvd.ProcessSet([3])]
for ps in sets:
    hvd.add_process_set(ps)
state = hvd.elastic.ObjectState(step=0, total=0.0)


@hvd.elastic.run
def train(state):
    while state.step < 30:
        if orig == 3 and state.step == 10:
            os.kill(os.getpid(), signal.SIGKILL)
        x = hvd.allreduce(np.ones(1), op=hvd.Sum, name="x")
        assert x[0] == hvd.size(), (x, hvd.size())
        for k, ps in enumerate(sets):
            if ps.process_set_id is not None and ps.included():
                y = hvd.allreduce(np.ones(1), op=hvd.Sum, name=f"set{k}", process_set=ps)
                assert y[0] == ps.size(), (k, y, ps)
        state.step += 1
        state.total += float(x[0])
        if state.step % 3 == 0:
            state.commit()


train(state)
described = ";".join(f"{ps.process_set_id}:{ps.ranks if ps.process_set_id is not None else None}" for ps in sets)
final = {"rank": hvd.rank(), "size": hvd.size(), "pid": os.getpid(), "step": state.step, "total": state.total,
         "sets": described.replace(" ", "")}
print(f"final orig={orig} " + " ".join(f"{k}={v}" for k, v in final.items()), flush=True)
report(orig, start={"pid": os.getpid()}, final=final)
hvd.shutdown()
