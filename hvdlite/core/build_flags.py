"""What this build of hvdlite supports (Horovod's ``*_built()`` / ``*_enabled()`` queries), in one place.

GPU and gloo support comes from the frontends' data planes (core/engine/planes.py), asked at run time."""
from __future__ import annotations

from typing import Callable

from . import runtime
from .engine.planes import built

#: framework name -> whether it sees a CUDA device here
_gpu_probes: dict[str, Callable[[], bool]] = {}


def register_gpu_probe(framework: str, probe: Callable[[], bool]) -> None:  # each frontend, when imported
    _gpu_probes[framework] = probe


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether frontend ``ext_base_name`` sees a CUDA device here; False for one not imported (Horovod's)."""
    probe = _gpu_probes.get("tensorflow" if ext_base_name == "keras" else ext_base_name)
    return bool(probe is not None and probe())


def mpi_enabled() -> bool:
    """True: MPI is the control plane and the host data plane."""
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    """True when this job runs torch CPU tensors through torch.distributed's gloo (HOROVOD_CPU_OPERATIONS=GLOO)."""
    if not runtime.is_initialized():
        return False
    current = runtime.state()
    return current.config.cpu_operations == "gloo" and current.planes.has("gloo")


def gloo_built() -> bool:
    """Whether a registered frontend can run gloo here (torch.distributed with gloo)."""
    return built("gloo")


def nccl_built() -> bool:
    """Whether a registered frontend can run NCCL here (torch built with CUDA, with NCCL)."""
    return built("nccl")


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether a registered frontend can place tensors on CUDA devices (torch built with CUDA)."""
    return built("cuda")


def rocm_built() -> bool:
    return False
