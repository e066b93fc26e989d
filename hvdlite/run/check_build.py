"""``hvdlite-run --check-build``: which frameworks, MPI library, thread level and launchers this install has."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from typing import Mapping, Optional

from .launchers import candidate_paths, find_srun, identify, mpi_library, srun_plugins, srun_version

#: A tiny program that initializes MPI as hvdlite does (asking for MPI_THREAD_MULTIPLE) and prints what the
#: library grants, as the MPI_THREAD_* constant's name.
_THREAD_PROBE = ("import mpi4py; mpi4py.rc.thread_level = 'multiple'\n"
                 "from mpi4py import MPI\n"
                 "names = {getattr(MPI, n): n for n in ('THREAD_SINGLE', 'THREAD_FUNNELED', "
                 "'THREAD_SERIALIZED', 'THREAD_MULTIPLE')}\n"
                 "print('MPI_' + names[MPI.Query_thread()])\n")


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def framework_versions() -> dict[str, Optional[str]]:
    """Version of each framework hvdlite has a frontend for, or None when it is not installed."""
    torch = _version("torch") if importlib.util.find_spec("torch") else None
    tensorflow = None
    if importlib.util.find_spec("tensorflow"):
        tensorflow = _version("tensorflow") or _version("tensorflow-cpu") or _version("tensorflow-gpu") or "?"
    keras = _version("keras") if importlib.util.find_spec("keras") else None
    keras3 = keras if keras and keras.split(".")[0].isdigit() and int(keras.split(".")[0]) >= 3 else None
    return {"PyTorch": torch, "TensorFlow": tensorflow, "Keras 3": keras3}


def thread_level(env: Mapping[str, str]) -> str:
    """The thread level MPI grants to a lone process that asks for MPI_THREAD_MULTIPLE."""
    clean = {k: v for k, v in env.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_COMM_WORLD", "SLURM_"))}
    try:
        proc = subprocess.run([sys.executable, "-c", _THREAD_PROBE], capture_output=True, text=True,
                              timeout=120, env=clean, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    if proc.returncode != 0 or not proc.stdout.strip():
        return f"unknown (MPI did not start: {proc.stderr.strip().splitlines()[-1:] or proc.returncode})"
    return proc.stdout.strip().splitlines()[-1]


#: Asks the torch frontend for Horovod's build flags: its data planes (gloo, NCCL) register when it is imported.
_FLAGS_PROBE = ("import json, hvdlite.torch as hvd\n"
                "print(json.dumps({name: getattr(hvd, name + '_built')() for name in "
                "('nccl', 'ddl', 'ccl', 'mpi', 'gloo')}))\n")


def built_flags(env: Mapping[str, str]) -> dict[str, bool]:
    """What ``hvd.nccl_built()``, ``hvd.gloo_built()`` ... say to a training script: asked of hvdlite.torch in
    a child process when torch is installed (the launcher itself never imports a framework), else of the
    core."""
    from ..core import launch as runtime
    flags = {"nccl": runtime.nccl_built(), "ddl": runtime.ddl_built(), "ccl": runtime.ccl_built(),
             "mpi": runtime.mpi_built(), "gloo": runtime.gloo_built()}
    if importlib.util.find_spec("torch") is None:
        return flags
    with contextlib.suppress(OSError, subprocess.TimeoutExpired, ValueError, IndexError):  # else the core's answer
        proc = subprocess.run([sys.executable, "-c", _FLAGS_PROBE], capture_output=True, text=True, timeout=300,
                              env=dict(env), stdin=subprocess.DEVNULL)
        flags.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return flags


def _box(flag: bool) -> str:
    return "[X]" if flag else "[ ]"


def report(env: Mapping[str, str]) -> str:
    """The --check-build text."""
    from .. import __version__

    lines = [f"hvdlite v{__version__}:", "", "Available frameworks:"]
    lines += [f"    {_box(version is not None)} {name}" + (f" {version}" if version else "")
              for name, version in framework_versions().items()]
    library = mpi_library()
    flags = built_flags(env)
    lines += ["", "Available controllers:",
              f"    {_box(library is not None and flags['mpi'])} MPI"
              + (f": {library.version}" if library else " (mpi4py cannot load an MPI library)"),
              f"    {_box(flags['gloo'])} Gloo" + (" (torch.distributed's gloo, for hvdlite.torch's CPU tensors)"
                                                   if flags["gloo"] else "")]
    lines += ["", f"MPI thread level: {thread_level(env) if library else 'n/a'}", "", "Available tensor operations:"]
    lines += [f"    {_box(flags[name.lower()])} {name}" for name in ("NCCL", "DDL", "CCL", "MPI", "Gloo")]
    launchers = [launcher for launcher in (identify(path, env) for path in candidate_paths(env)) if launcher]
    lines += ["", "Launchers:", *(f"    [X] {launcher.describe()}" for launcher in launchers)]
    if not launchers:
        lines.append("    [ ] mpiexec/mpirun: none found (pip install mpich, or load your cluster's MPI)")
    srun = find_srun(env)
    if srun:
        plugins = srun_plugins(srun, env)
        lines.append(f"    [X] {srun_version(srun, env)} ({srun}); --mpi plugins: "
                     f"{', '.join(plugins) if plugins else 'unknown (no Slurm configuration here)'}")
    else:
        lines.append("    [ ] srun: not found")
    return "\n".join(lines)
