"""Worker: runs torch_ops.py, torch_optimizer.py, then torch_horovod_style.py in one MPI job (one start-up).

Each script is also runnable on its own; between them hvdlite is shut down and initialised again.
"""
import runpy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for script, args in (("torch_ops.py", []), ("torch_optimizer.py", []),
                     ("torch_horovod_style.py", ["--fp16-allreduce"])):
    sys.argv = [str(HERE / script)] + args
    runpy.run_path(str(HERE / script), run_name="__main__")
    torch.set_default_dtype(torch.float32)  # undo torch_optimizer.py's float64 default
