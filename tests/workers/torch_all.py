"""Worker: runs torch_ops.py, torch_optimizer.py (gradient overlap on, then off) and torch_horovod_style.py
in one MPI job (one start-up).

Each script is also runnable on its own; between them hvdlite is shut down and initialised again.
"""
import os
import runpy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for script, args, overlap in (("torch_ops.py", [], "auto"), ("torch_optimizer.py", [], "on"),
                              ("torch_optimizer.py", [], "off"),
                              ("torch_horovod_style.py", ["--fp16-allreduce"], "auto")):
    os.environ["HVDLITE_GRADIENT_OVERLAP"] = overlap  # read by hvd.init() at the top of each script
    sys.argv = [str(HERE / script)] + args
    runpy.run_path(str(HERE / script), run_name="__main__")
    torch.set_default_dtype(torch.float32)  # undo torch_optimizer.py's float64 default
