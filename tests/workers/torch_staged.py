"""Worker: torch_ops.py and torch_optimizer.py again, with every tensor staged through a host copy.

This is the path CUDA tensors take (hvdlite/torch/tensors.py); forcing it for CPU tensors runs that code on
machines without a GPU. Run by tests/test_torch_mpi.py under ``mpiexec -n 2`` and ``-n 3``.
"""
import runpy
import sys
from pathlib import Path

import torch

import hvdlite.torch.tensors as tensors

tensors.STAGE_EVERY_TENSOR = True
probe = torch.arange(4.0)
array, shared = tensors.to_host(probe, "probe")
assert not shared and array.ctypes.data != probe.data_ptr(), "staging was not forced"

HERE = Path(__file__).resolve().parent
for script in ("torch_ops.py", "torch_optimizer.py"):
    sys.argv = [str(HERE / script)]
    runpy.run_path(str(HERE / script), run_name="__main__")
    torch.set_default_dtype(torch.float32)  # undo torch_optimizer.py's float64 default
