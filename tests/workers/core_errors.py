"""Every mismatch raises the same error on every rank, naming the tensor and ranks; the engine goes on."""
import numpy as np

import hvdlite as hvd
from _check import raises, same

hvd.init()
r, n = hvd.rank(), hvd.size()
last = n - 1
odd = r == last  # the last rank disagrees
E = hvd.TensorMismatchError

cases = {
    "shape": lambda: hvd.allreduce(np.ones(4 if odd else 3), name="t.shape"),
    "dtype": lambda: hvd.allreduce(np.ones(3, np.float64 if odd else np.float32), name="t.dtype"),
    "reduce op": lambda: hvd.allreduce(np.ones(3), op=hvd.Max if odd else hvd.Sum, name="t.op"),
    "prescale_factor": lambda: hvd.allreduce(np.ones(3), prescale_factor=2.0 if odd else 1.0, name="t.pre"),
    "postscale_factor": lambda: hvd.allreduce(np.ones(3), postscale_factor=3.0 if odd else 1.0, name="t.post"),
    "root rank": lambda: hvd.broadcast(np.ones(3), root_rank=1 if odd else 0, name="t.root"),
    "shape beyond the first dimension": lambda: hvd.allgather(np.ones((1, 3 if odd else 2)), name="t.ag"),
    "operation": lambda: (hvd.allgather if odd else hvd.allreduce)(np.ones(3), name="t.kind"),
}
messages = {}
for field, call in cases.items():
    messages[field] = raises(E, call, f"the {field} differs across ranks")
    assert f"rank {last}" in messages[field], messages[field]
    # the engine still works after each error
    same(hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"after.{field}"), np.full(2, float(n)), "after", r)

exact = messages["shape"].split(": ", 1)[1]  # drop the "rank r:" prefix; the rest is identical everywhere
expected_shape = "; ".join(
    ([f"ranks {', '.join(map(str, range(last)))}: (3,)" if last > 1 else "rank 0: (3,)"]) + [f"rank {last}: (4,)"])
assert exact == (f"Mismatched allreduce for tensor 't.shape': the shape differs across ranks ({expected_shape}). "
                 f"Every rank must submit a name with the same shape; give different tensors different names."), exact
everyone = hvd.allgather_object(exact)
assert len(set(everyone)) == 1, everyone

# a name already in flight is rejected at submit, with the fix in the message
h = hvd.allreduce_async(np.ones(1), name="dup")
raises(hvd.HvdliteError, lambda: hvd.allreduce_async(np.ones(1), name="dup"), "already in flight")
hvd.synchronize(h)

# a mismatch inside a process set
raises(ValueError, lambda: hvd.add_process_set(list(range(n))), "already registered")  # that is the global set
if n >= 3:  # ranks 0 and last agree to use the set {0, last}, but the last rank passes the global set
    ps = hvd.add_process_set([0, last])
    if r in (0, last):
        raises(E, lambda: hvd.allreduce(np.ones(2), name="t.ps",
                                        process_set=hvd.global_process_set if odd else ps), "the process set differs")
raises(NotImplementedError, lambda: hvd.allreduce(np.ones(2), op=hvd.Adasum), "Adasum")
hvd.barrier()
print(f"OK rank {r}")
