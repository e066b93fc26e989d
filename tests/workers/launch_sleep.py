"""Launch-test worker: start hvdlite, write this rank's pid to DIR/<rank>.pid, then wait (at most 120 s).

Used to check that interrupting the launcher stops every rank.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import hvdlite as hvd

hvd.init()
Path(sys.argv[1], f"{hvd.rank()}.pid").write_text(str(os.getpid()))
hvd.barrier()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.2)
sys.exit(0)
