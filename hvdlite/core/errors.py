"""Exception classes raised by hvdlite, shared by every frontend."""
from __future__ import annotations


class HvdliteError(RuntimeError):
    """Base class of every error hvdlite raises from a collective or its runtime (alias: HorovodInternalError)."""


class NotInitializedError(HvdliteError, ValueError):
    """An hvdlite function was called before ``hvd.init()``."""


class TensorMismatchError(HvdliteError, ValueError):
    """Ranks submitted the same tensor name with different shapes, dtypes or arguments."""


class InvalidArgumentError(HvdliteError, ValueError):
    """An argument of a collective cannot work (a root rank outside the set): every member gets it."""


class DuplicateNameError(HvdliteError, ValueError):
    """A collective was submitted under a name that is already in flight (Horovod raises ValueError)."""


class ShutdownError(HvdliteError):
    """hvdlite was shut down (locally, by another rank, or by an engine failure)."""


class StallError(HvdliteError):
    """A collective waited longer than ``stall_shutdown_time_seconds`` for other ranks."""


class ProcessFailedError(HvdliteError):
    """A rank of the job died: raised on every survivor by every pending and later collective under an MPI with
    ULFM turned on (``ranks``/``hosts``: the lost ones known here; ``seen_at``: ``time.time()`` it was seen).
    ``hvd.elastic.run`` recovers from it in the same process (docs/elastic.md)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), hosts: tuple[str, ...] = (),
                 seen_at: float = 0.0) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.hosts = hosts
        self.seen_at = seen_at


def lost_rank(exc: BaseException | None, ended: BaseException | None = None) -> ProcessFailedError | None:
    """The lost-rank error behind ``exc`` (it, or one it was raised from), else ``ended`` if it is one: the error
    the engine ended with, which TensorFlow re-raises as its own UnknownError, not chained."""
    for _ in range(8):
        if exc is None or isinstance(exc, ProcessFailedError):
            break
        exc = exc.__cause__ or exc.__context__
    if isinstance(exc, ProcessFailedError):
        return exc
    return ended if isinstance(ended, ProcessFailedError) else None


class ReplicaDivergenceError(HvdliteError):
    """``check_replicas`` found a tensor that is not bit-identical on every rank (raised on every rank):
    ``tensor`` the first, ``ranks`` those that differ from the most common copy, by up to ``max_abs_diff``."""

    def __init__(self, message: str, tensor: str = "", ranks: tuple[int, ...] = (), max_abs_diff: float = float("nan"),
                 tensors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.ranks = ranks
        self.max_abs_diff = max_abs_diff
        self.tensors = tensors


class LaunchError(HvdliteError):
    """The job cannot be launched, or was launched so that it cannot work (``hvd.init()``, ``hvdlite-run``)."""


HorovodInternalError = HvdliteError
