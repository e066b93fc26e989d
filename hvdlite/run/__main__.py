"""``hvdlite-run`` / ``python -m hvdlite.run``: pick a launcher, build its command, run it, return its exit code."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Mapping, Optional, Sequence

from ..core.launch import Config, environ, launcher_mismatch
from .args import env_assignments, is_elastic, jsrun_refusal, no_effect_warnings, parse_args, tuning_environment
from .commands import (Plan, build_command, child_environment, format_command, rank_wrapper, resolve_program,
                       ssh_arguments)
from .hosts import HostSpecError, check_slots, parse_hostfile, parse_hosts, slurm_allocation, total_slots
from .launchers import (MPICH, SRUN, Launcher, LaunchError, choose_srun_mpi, find_mpi_launcher,
                        find_srun, mpi_library, srun_plugins, srun_version)


def plan_launch(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Launcher, Plan, list[str]]:
    """Choose the launcher and work out the plan; also return warnings to show. Raises on a plan that
    cannot work (no launcher, too few slots, bad host list)."""
    if args.use_jsrun:
        raise LaunchError(jsrun_refusal(env))
    hosts = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile) if args.hostfile else None
    allocation = slurm_allocation(env)
    library = mpi_library()
    kind = args.launcher
    if kind == "auto" and allocation is not None and hosts is None and find_srun(env):
        kind = SRUN
    srun_mpi = ""
    if kind == SRUN:
        srun = find_srun(env)
        if srun is None:
            raise LaunchError("--launcher srun: no srun on PATH (is Slurm installed here?)")
        if hosts is not None:
            raise LaunchError("srun places ranks on the allocation's nodes itself: drop -H/--hostfile, or "
                                "use --launcher mpich/openmpi")
        srun_mpi = args.srun_mpi or choose_srun_mpi(library, srun_plugins(srun, env))
        launcher = Launcher(SRUN, srun, srun_version(srun, env))
    else:
        launcher = find_mpi_launcher(env, want=None if kind == "auto" else kind, library=library)
        problem = launcher_mismatch(library.version, launcher.kind, launcher.describe()) if library else ""
        if problem:
            raise LaunchError(problem)

    num_proc = args.num_proc
    if num_proc is None:
        if hosts is not None:
            num_proc = total_slots(hosts)
        elif allocation is not None and allocation.tasks:
            num_proc = allocation.tasks
        else:
            raise HostSpecError("give the number of processes: hvdlite-run -np N ... (or -H host:slots)")
    if num_proc < 1:
        raise HostSpecError(f"-np must be at least 1, got {num_proc}")
    if hosts is not None:
        check_slots(num_proc, hosts)
    elif allocation and allocation.tasks and launcher.kind in (SRUN, MPICH) and num_proc > allocation.tasks:
        raise HostSpecError(f"asked for {num_proc} processes (-np {num_proc}) but Slurm job {allocation.job_id} "
                            f"has only {allocation.tasks} tasks; ask sbatch/salloc for more (-N nodes "
                            f"--ntasks-per-node=K) or lower -np")

    extra_env = env_assignments(args.env, dict(env))
    extra_env.update(tuning_environment(args))
    warnings = args.config_notes + no_effect_warnings(args)
    ssh_args = ssh_arguments(args.ssh_port, args.ssh_identity_file, args.start_timeout)
    if ssh_args and launcher.kind == SRUN:
        warnings.append("-p/--ssh-port, -i/--ssh-identity-file and --start-timeout have no effect under srun "
                        "(Slurm starts the ranks, not ssh)")
        ssh_args = []
    if args.start_timeout is not None and args.start_timeout < 1:
        raise ValueError(f"--start-timeout must be at least 1 second, got {args.start_timeout}")
    sentinel = Config.setting("launch_sentinel", env) if args.launch_sentinel is None else args.launch_sentinel
    command = rank_wrapper(sentinel, args.output_filename, args.prefix_output_with_timestamp, sys.executable)
    plan = Plan(num_proc=num_proc, command=command + resolve_program(args.command, env), hosts=hosts,
                extra_env=extra_env, mpi_args=shlex.split(args.mpi_args), network_interfaces=list(args.nics or []),
                srun_mpi=srun_mpi or "pmi2", in_slurm=allocation is not None, ssh_args=ssh_args,
                is_root=hasattr(os, "geteuid") and os.geteuid() == 0,
                binding_args=None if args.binding_args is None else shlex.split(args.binding_args))
    return launcher, plan, warnings


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run hvdlite-run with ``argv`` (default: sys.argv[1:]); return the job's exit code."""
    args = parse_args(argv)
    env = dict(environ())
    if args.version:
        from .. import __version__
        print(f"hvdlite {__version__}")
        return 0
    if args.check_build:
        from .check_build import report
        print(report(env), flush=True)
        return 0
    if is_elastic(args):
        from .elastic import run_elastic
        return run_elastic(args, env, plan_launch)
    try:
        launcher, plan, warnings = plan_launch(args, env)
    except (HostSpecError, LaunchError, ValueError) as exc:
        print(f"hvdlite-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    for warning in warnings:
        print(f"hvdlite-run: warning: {warning}", file=sys.stderr, flush=True)
    child_env = child_environment(env, plan, launcher)
    cmd = build_command(launcher, plan, child_env)
    if args.verbose:
        added = {k: v for k, v in child_env.items() if env.get(k) != v}
        print(f"hvdlite-run: launcher: {launcher.describe()}", flush=True)
        print(f"hvdlite-run: running: {format_command(cmd, added)}", flush=True)
    from .process import run
    try:
        return run(cmd, child_env, srun=launcher.kind == SRUN)
    except OSError as exc:
        print(f"hvdlite-run: error: cannot start {cmd[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main())
