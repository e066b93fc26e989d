"""The engine: one background thread per process that runs every tensor collective.

Read in pipeline order: ``requests`` (what a rank submits) -> ``loop`` (the thread and its cycle) ->
``negotiation`` (agreeing, identically on every rank, what runs now) -> ``fusion`` (batching agreed tensors)
-> ``execution`` and ``row_exec`` (the MPI calls, all non-blocking; ``plane_exec`` for data planes) ->
``dispatch`` and ``handles`` (results and errors back to user threads). ``stalls`` watches for stalls and
wedged waits. ``mpi`` is the only importer of mpi4py; ``psets`` holds each process set's communicator;
``polling`` waits on MPI requests without taking the training thread's core; ``timeline`` traces it all.
Nothing outside hvdlite.core may import this package.
"""
