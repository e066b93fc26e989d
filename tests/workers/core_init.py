"""init(comm=list of ranks), init(comm=communicator) and init(process_sets=...)."""
import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from _check import raises, same

world = MPI.COMM_WORLD
me, n = world.Get_rank(), world.Get_size()

# a list of world ranks: the others are told they are not in it
members = [0, 1]
if me in members:
    hvd.init(comm=members)
    assert (hvd.rank(), hvd.size()) == (me, 2)
    same(hvd.allreduce(np.ones(2), op=hvd.Sum), np.full(2, 2.0), "sub-world allreduce", me)
    hvd.shutdown()
else:
    raises(hvd.LaunchError, lambda: hvd.init(comm=members), f"rank {me} of MPI_COMM_WORLD is not in init(comm=[0, 1])")

# an mpi4py communicator: the world reversed
reversed_comm = world.Split(0, key=n - 1 - me)
hvd.init(comm=reversed_comm)
assert hvd.rank() == n - 1 - me and hvd.size() == n
same(hvd.broadcast(np.array([me]), root_rank=0), np.array([n - 1]), "reversed world root", me)
hvd.shutdown()

# process sets registered at init
first, rest = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, n))
hvd.init(process_sets=[first, rest])
assert first.process_set_id is not None and rest.process_set_id is not None
mine = first if me == 0 else rest
same(hvd.allreduce(np.array([me]), op=hvd.Sum, process_set=mine),
     np.array([0 if me == 0 else sum(range(1, n))]), "init process sets", me)
assert hvd.local_size() == n and hvd.cross_size() == 1 and hvd.local_rank() == me  # one host
assert hvd.is_homogeneous()
print(f"OK rank {me}")
