"""The engine: one background thread per process that runs every tensor collective.

Read in pipeline order: ``requests`` (what a rank submits) and ``handles`` (what it waits on) -> ``loop`` (the
thread and its cycle) -> ``negotiation`` (the round protocol and ``decide``: agreeing, identically on every
rank, what runs now), with ``cache`` (the response cache: names agreed before, one bit each) and ``mismatch``
(the text of mismatches and stalls) -> ``fusion`` (batching agreed tensors) -> ``completion`` (the pending
table; hands each batch to ``execution``, ``row_exec`` or ``plane_exec`` and ends every request) ->
``execution`` (``chunks`` in flight, ``accumulate``, ``deterministic``, ``adasum``) and ``row_exec`` (the MPI
calls, all non-blocking), ``plane_exec`` and ``planes`` (data planes). Around them: ``stalls`` and
``presence`` watch for stalls and wedged waits; ``stragglers`` and ``callsite`` say who was late and where;
``autotune`` tunes the settings; ``eviction`` orders the cache; ``mpi`` is the only importer of mpi4py;
``psets`` holds each process set's communicator; ``polling`` waits on MPI requests without taking the
training thread's core; ``timeline`` traces it all.
Nothing outside hvdlite.core may import this package.
"""
