"""Exception classes raised by hvdlite, shared by every frontend."""
from __future__ import annotations


class HvdliteError(RuntimeError):
    """Base class of every error hvdlite raises from a collective or its runtime.

    ``HorovodInternalError`` is an alias, so ``except hvd.HorovodInternalError`` in a
    script migrated from Horovod keeps working.
    """


class NotInitializedError(HvdliteError, ValueError):
    """An hvdlite function was called before ``hvd.init()``."""


class TensorMismatchError(HvdliteError, ValueError):
    """Ranks submitted the same tensor name with different shapes, dtypes or arguments."""


class InvalidArgumentError(HvdliteError, ValueError):
    """An argument of a collective cannot work (for example a root rank outside the process set); every
    member of the set gets this error for the op (Horovod raises ValueError)."""


class DuplicateNameError(HvdliteError, ValueError):
    """A collective was submitted under a name that is already in flight (Horovod raises ValueError)."""


class ShutdownError(HvdliteError):
    """hvdlite was shut down (locally, by another rank, or by an engine failure)."""


class StallError(HvdliteError):
    """A collective waited longer than ``stall_shutdown_time_seconds`` for other ranks."""


class ProcessFailedError(HvdliteError):
    """A rank of the job died (killed, crashed, its host lost): raised on every survivor by every pending and
    later collective, under an MPI with fault tolerance turned on (ULFM). ``ranks``: the lost ranks this rank
    knew of when it failed; ``hosts``: their hosts; ``seen_at``: when this rank saw it (``time.time()``).
    ``hvd.elastic.run`` recovers from it in the same process (see docs/elastic.md); elsewhere it ends the job
    like any HorovodInternalError."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), hosts: tuple[str, ...] = (),
                 seen_at: float = 0.0) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.hosts = hosts
        self.seen_at = seen_at


class ReplicaDivergenceError(HvdliteError):
    """``check_replicas`` found a tensor that is not bit-identical on every rank (raised on every rank).

    ``tensor``: the first differing tensor's name; ``ranks``: the ranks whose copy differs from the most
    common one; ``max_abs_diff``: the largest absolute difference to it; ``tensors``: every differing name.
    """

    def __init__(self, message: str, tensor: str = "", ranks: tuple[int, ...] = (), max_abs_diff: float = float("nan"),
                 tensors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.ranks = ranks
        self.max_abs_diff = max_abs_diff
        self.tensors = tensors


class LaunchError(HvdliteError):
    """The job cannot be launched, or was launched in a way that cannot work: raised by ``hvd.init()`` (for
    example srun without PMI) and by ``hvdlite-run`` (no usable mpiexec/mpirun/srun)."""


HorovodInternalError = HvdliteError
