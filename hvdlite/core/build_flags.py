"""What this build of hvdlite supports (Horovod's ``*_built()`` / ``*_enabled()`` queries), in one place."""
from __future__ import annotations

__all__ = ["mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
           "cuda_built", "rocm_built"]


def mpi_enabled() -> bool:
    """True: MPI is the control plane and the host data plane."""
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False
