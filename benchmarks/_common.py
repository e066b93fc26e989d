"""Helpers shared by the benchmarks: JSON-line output, machine description, timing across ranks, gloo set-up."""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path = ROOT) -> str:
    """The checkout's commit, "+dirty" where its hvdlite/ has changes ("unknown" outside git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hvdlite"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(bench: str, ranks: int, **extra: Any) -> dict[str, Any]:
    """One JSON-able description of where and with what a benchmark ran."""
    from mpi4py import MPI
    import hvdlite
    info: dict[str, Any] = {
        "bench": bench, "kind": "machine", "ranks": ranks,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count(),
        "python": platform.python_version(), "numpy": np.__version__, "mpi4py": importlib.import_module(
            "mpi4py").__version__, "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "mpi_thread_level": MPI.Query_thread(), "hvdlite": hvdlite.__version__, "commit": git_commit(),
    }
    try:
        info["loadavg_1min"] = os.getloadavg()[0]
    except OSError:
        pass
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    info.update(extra)
    return info


class Output:
    """Prints JSON lines (rank 0 only) and, with ``path``, also writes them to a file."""

    def __init__(self, rank: int, path: Optional[str]) -> None:
        self.rank = rank
        self.file = None
        if rank == 0 and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w", encoding="utf-8")

    def emit(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        line = json.dumps(record, sort_keys=False, default=_jsonable)
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    return str(value)


@dataclasses.dataclass
class Series:
    """The per-repetition times of one method on this rank (seconds); summarised across ranks."""

    name: str
    times: list[float] = dataclasses.field(default_factory=list)
    extra: dict[str, float] = dataclasses.field(default_factory=dict)


def timed(comm: Any, fn: Callable[[], Any]) -> float:
    """Barrier, then the seconds ``fn`` takes on this rank."""
    comm.Barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(comm: Any, series: Series) -> dict[str, float]:
    """Per repetition, the slowest rank's time; then median, min, max over repetitions (milliseconds)."""
    from mpi4py import MPI
    local = np.asarray(series.times, dtype=np.float64)
    worst = np.empty_like(local)
    comm.Allreduce(local, worst, op=MPI.MAX)
    ms = sorted(float(t) * 1e3 for t in worst)
    return {"ms": statistics.median(ms), "ms_min": ms[0], "ms_max": ms[-1], "reps": len(ms)}


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings into init() keywords (values stay strings; hvdlite's Config parses them)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--hvd-setting wants key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_gloo(comm: Any, timeout_s: float = 120.0) -> None:
    """torch.distributed over gloo with the MPI rank and size; rank 0 picks a free port and tells the rest."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(__import__("mpi4py").MPI.COMM_TYPE_SHARED)
    same_node = local.Get_size() == size
    local.Free()
    addr, port = comm.bcast(("127.0.0.1" if same_node else socket.gethostbyname(socket.gethostname()),
                             free_port()) if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def mpiexec_beside(python: str = sys.executable) -> str:
    """The mpiexec beside ``python`` (a virtualenv's own MPI) if there is one, else the first on PATH."""
    beside = Path(python).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise SystemExit("no mpiexec beside the Python or on PATH (pip install mpich)")
    return found


def load_hvd_module(name: str) -> Any:
    """Import a Horovod-compatible module (``horovod.torch``, ``hvdlite.torch``...) and init() it."""
    module = importlib.import_module(name)
    module.init()
    return module


def idle_cpu_percent(seconds: float) -> float:
    """Percent of one core this process burns while the calling thread sleeps for ``seconds``."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return 100.0 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)
