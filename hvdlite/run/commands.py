"""Build the exact launcher command line (hydra mpiexec, Open MPI mpirun or srun) and the ranks' environment."""
from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
from typing import Mapping, Optional, Sequence

from .hosts import Host
from .launchers import MPICH, OPENMPI, SRUN, Launcher

#: Variables Open MPI's mpirun must be told to forward (-x) so remote ranks find Python and hvdlite;
#: hydra and srun pass the whole environment already.
FORWARDED_BY_DEFAULT = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED")
FORWARDED_PREFIXES = ("HVDLITE_", "HOROVOD_")
#: Set in every rank so hvdlite knows it was started by hvdlite-run.
LAUNCHED_BY = "HVDLITE_LAUNCHED_BY"


@dataclasses.dataclass
class Plan:
    """What to launch: the process count, where, the program, and what each rank gets."""

    num_proc: int
    command: list[str]
    hosts: Optional[list[Host]] = None
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)  # -x values and tuning flags
    mpi_args: list[str] = dataclasses.field(default_factory=list)
    network_interfaces: list[str] = dataclasses.field(default_factory=list)
    srun_mpi: str = "pmi2"
    in_slurm: bool = False
    is_root: bool = False
    ssh_args: list[str] = dataclasses.field(default_factory=list)  # -p PORT -i FILE -o ConnectTimeout=S
    binding_args: Optional[list[str]] = None  # replaces hvdlite-run's own binding flags when given


def ssh_arguments(port: Optional[int], identity_file: Optional[str], start_timeout: Optional[int]) -> list[str]:
    """ssh options for the launcher's remote starts (horovodrun's -p, -i and --start-timeout)."""
    args: list[str] = []
    if port is not None:
        args += ["-p", str(port)]
    if identity_file:
        args += ["-i", identity_file]
    if start_timeout is not None:
        args += ["-o", f"ConnectTimeout={start_timeout}"]
    return args


#: The per-rank wrapper, run by path so that it does not import the hvdlite package (see its docstring).
SENTINEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sentinel.py")


def rank_wrapper(sentinel: bool, directory: Optional[str], timestamp: bool, python: str) -> list[str]:
    """What goes in front of the program: the sentinel that names a rank a signal kills (launch_sentinel), which
    also copies the output for --output-filename / --prefix-output-with-timestamp."""
    if not (sentinel or directory or timestamp):
        return []
    wrapper = [python, "-S", SENTINEL]
    if directory:
        wrapper += ["--dir", os.path.abspath(directory)]
    if timestamp:
        wrapper.append("--timestamp")
    return wrapper + ([] if sentinel else ["--exec"]) + ["--"]


def resolve_program(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The command with its program named by the path found on our PATH (symlinks kept), as the user's shell
    would run it: the ranks' PATH may differ (Open MPI's mpirun puts its own bin/ first, README "Launching")."""
    if not command or os.sep in command[0]:
        return list(command)
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    return [os.path.abspath(found), *command[1:]] if found else list(command)


def child_environment(base: Mapping[str, str], plan: Plan, launcher: Launcher) -> dict[str, str]:
    """The launcher's environment: ours, plus -x values, tuning settings and Open MPI's root switches."""
    env = dict(base)
    env.update(plan.extra_env)
    env[LAUNCHED_BY] = f"hvdlite-run/{launcher.kind}"
    if launcher.kind == OPENMPI and plan.is_root:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    if launcher.kind == MPICH and plan.ssh_args:
        env["HYDRA_LAUNCHER_EXTRA_ARGS"] = " ".join(shlex.quote(a) for a in plan.ssh_args)
    return env


def build_command(launcher: Launcher, plan: Plan, env: Mapping[str, str]) -> list[str]:
    """The full command line for ``launcher``: its own part, then ``--mpi-args``, then the program; ``env`` is the
    child environment (for Open MPI's -x list)."""
    if launcher.kind == OPENMPI:
        cmd = openmpi_command(launcher.path, plan, env)
    else:
        cmd = {MPICH: mpich_command, SRUN: srun_command}[launcher.kind](launcher.path, plan)
    return cmd + list(plan.mpi_args) + list(plan.command)


def mpich_command(path: str, plan: Plan) -> list[str]:
    """MPICH hydra, which passes the whole environment to every rank: the -x values go as -genv (which adds to
    it); hydra's connections take the first NIC (-iface), UCX all of them (UCX_NET_DEVICES)."""
    cmd = [path, "-n", str(plan.num_proc)]
    if plan.hosts:
        cmd += ["-hosts", ",".join(str(h) for h in plan.hosts)]
    if plan.network_interfaces:
        cmd += ["-iface", plan.network_interfaces[0]]
    if plan.ssh_args:
        cmd += ["-launcher", "ssh"]
    extra = dict(plan.extra_env)
    if plan.network_interfaces:
        extra.setdefault("UCX_NET_DEVICES", ",".join(plan.network_interfaces))
    for name in sorted(extra):
        cmd += ["-genv", name, extra[name]]
    return cmd + list(plan.binding_args or [])


def openmpi_command(path: str, plan: Plan, env: Mapping[str, str]) -> list[str]:
    """Open MPI's mpirun, which refuses root without --allow-run-as-root, binds each rank to one core by default
    (wrong for a rank with several threads) and forwards to other hosts only the variables named with -x."""
    cmd = [path]
    if plan.is_root:
        cmd.append("--allow-run-as-root")
    cmd += ["-np", str(plan.num_proc)]
    if plan.hosts:
        cmd += ["-H", ",".join(str(h) for h in plan.hosts)]
    elif not plan.in_slurm:
        cmd += ["-H", f"localhost:{plan.num_proc}"]
    cmd += plan.binding_args if plan.binding_args is not None else ["--bind-to", "none", "--map-by", "slot"]
    if plan.network_interfaces:
        nics = ",".join(plan.network_interfaces)
        cmd += ["--mca", "btl_tcp_if_include", nics, "--mca", "oob_tcp_if_include", nics]
    if plan.ssh_args:
        cmd += ["--mca", "plm_rsh_args", " ".join(plan.ssh_args)]
    if keeps_user_path(path, plan):
        cmd.append("--noprefix")
    names = set(plan.extra_env) | {LAUNCHED_BY}
    names |= {name for name in env if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_BY_DEFAULT}
    for name in sorted(names):
        cmd += ["-x", name]
    return cmd


#: Where a system's Open MPI lives: its orted is on every host's default PATH, no --prefix needed to find it.
SYSTEM_BIN = ("/usr/bin", "/bin", "/usr/local/bin")


def keeps_user_path(path: str, plan: Plan) -> bool:
    """Whether Open MPI's mpirun gets --noprefix, so the ranks' PATH is the user's (docs/system-mpi.md): not for a
    multi-host job of an Open MPI outside the system's directories (its hosts need the prefix to find orted), nor
    when --mpi-args gives --prefix or --noprefix."""
    if any(arg in ("--prefix", "-prefix", "--noprefix", "-noprefix") for arg in plan.mpi_args):
        return False
    return os.path.dirname(path) in SYSTEM_BIN or not (plan.hosts or plan.in_slurm)


def srun_command(path: str, plan: Plan) -> list[str]:
    """Slurm: --mpi gives the ranks a PMI (without it each is a size-1 job), --export=ALL passes the -x values even
    under sbatch --export=NONE."""
    cmd = [path, "-n", str(plan.num_proc), f"--mpi={plan.srun_mpi}", "--kill-on-bad-exit=1", "--export=ALL"]
    return cmd + list(plan.binding_args or [])


def format_command(cmd: Sequence[str], extra_env: Mapping[str, str]) -> str:
    """A shell-ready rendering of the command with the variables it adds, for --verbose."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra_env.items()))
    line = " ".join(shlex.quote(part) for part in cmd)
    return f"{prefix} {line}" if prefix else line
