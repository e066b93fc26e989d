"""Worker: runs torch_ops.py, torch_optimizer.py (gradient overlap on, then off) and torch_horovod_style.py
in one MPI job (one start-up).

With ``--staged``, runs torch_ops.py and torch_optimizer.py instead with every tensor staged through a host
copy: the path CUDA tensors take (hvdlite/torch/tensors.py), forced for CPU tensors so that it runs on
machines without a GPU.

Each script is also runnable on its own; between them hvdlite is shut down and initialised again.
"""
import os
import runpy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PLAN = [("torch_ops.py", [], "auto"), ("torch_optimizer.py", [], "on"), ("torch_optimizer.py", [], "off"),
        ("torch_horovod_style.py", ["--fp16-allreduce"], "auto")]
if "--staged" in sys.argv[1:]:
    import hvdlite.torch.tensors as tensors
    tensors.STAGE_EVERY_TENSOR = True
    probe = torch.arange(4.0)
    array, shared = tensors.to_host(probe, "probe")
    assert not shared and array.ctypes.data != probe.data_ptr(), "staging was not forced"
    PLAN = [("torch_ops.py", [], "auto"), ("torch_optimizer.py", [], "auto")]

for script, args, overlap in PLAN:
    os.environ["HVDLITE_GRADIENT_OVERLAP"] = overlap  # read by hvd.init() at the top of each script
    sys.argv = [str(HERE / script)] + args
    runpy.run_path(str(HERE / script), run_name="__main__")
    torch.set_default_dtype(torch.float32)  # undo torch_optimizer.py's float64 default
