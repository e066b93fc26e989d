"""HvdliteEnvironment: Lightning's view of the job (rank, size, node) taken from hvdlite, whose launcher made it."""
from __future__ import annotations

import logging

from lightning.fabric.plugins import ClusterEnvironment

import hvdlite.torch as hvd

__all__ = ["HvdliteEnvironment"]

_log = logging.getLogger(__name__)


class HvdliteEnvironment(ClusterEnvironment):
    """The processes were started by mpiexec, hvdlite-run or srun; hvdlite (MPI) already connects them, so
    there is no rendezvous address or port and Lightning may not change the ranks."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return ""  # nothing rendezvous-based is started: hvdlite's MPI runtime connects the ranks

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return hvd.is_initialized()

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != hvd.size():
            _log.debug("HvdliteEnvironment: world size %d asked for, the launcher started %d", size, hvd.size())

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != hvd.rank():
            _log.debug("HvdliteEnvironment: rank %d asked for, the launcher made this rank %d", rank, hvd.rank())

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()
