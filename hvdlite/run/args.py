"""Command-line flags of hvdlite-run (Horovod's everyday ``horovodrun`` flags plus a few of our own)."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

#: hvdlite-run tuning flags and the hvdlite setting (``HVDLITE_<NAME>``) each one sets for every rank,
#: with a scale applied to the flag's value (MiB -> bytes).
TUNING_FLAGS: dict[str, tuple[str, float]] = {
    "fusion_threshold_mb": ("fusion_threshold", 1024 * 1024),
    "cycle_time_ms": ("cycle_time", 1),
    "cache_capacity": ("cache_capacity", 1),
    "timeline_filename": ("timeline", 1),
    "timeline_mark_cycles": ("timeline_mark_cycles", 1),
    "log_level": ("log_level", 1),
    "stall_check_warning_time_seconds": ("stall_check_time_seconds", 1),
    "stall_check_shutdown_time_seconds": ("stall_shutdown_time_seconds", 1),
    "no_stall_check": ("stall_check_disable", 1),
}

LAUNCHERS = ("auto", "mpich", "openmpi", "srun")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdlite-run",
        description="Start one hvdlite process per slot (GPU) with MPICH's mpiexec, Open MPI's mpirun, or "
                    "srun inside a Slurm allocation.",
        epilog="examples:\n"
               "  hvdlite-run -np 4 python train.py\n"
               "  hvdlite-run -np 8 -H node1:4,node2:4 python train.py\n"
               "  hvdlite-run --check-build\n"
               "inside sbatch/salloc, hvdlite-run uses srun with the --mpi plugin your MPI library needs.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                        help="number of processes (default: all slots of -H/--hostfile, or the Slurm "
                             "allocation's tasks)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and how many processes each runs, e.g. node1:4,node2:4 (default: this host)")
    hosts.add_argument("-hostfile", "--hostfile", dest="hostfile", metavar="FILE",
                       help="file with one host a line: 'hostname slots=N' (or hostname:N)")
    parser.add_argument("-x", "--env", dest="env", action="append", default=[], metavar="VAR[=VALUE]",
                        help="pass this environment variable to every rank (its current value, or VALUE); "
                             "repeatable")
    parser.add_argument("--mpi-args", dest="mpi_args", default="", metavar='"ARGS"',
                        help='extra arguments for the MPI launcher (mpiexec, mpirun or srun), e.g. '
                             '--mpi-args="-genv FOO 1"')
    parser.add_argument("--network-interface", dest="network_interface", metavar="NIC",
                        help="network interface for MPI traffic between hosts (e.g. eth0, ib0)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                        help="which launcher to drive (default: srun inside a Slurm allocation, else the "
                             "mpiexec/mpirun that matches the MPI library mpi4py loads)")
    parser.add_argument("--srun-mpi", dest="srun_mpi", metavar="PLUGIN",
                        help="srun --mpi plugin (default: pmi2 for MPICH-based MPI, pmix for Open MPI)")
    parser.add_argument("--verbose", action="store_true", help="print the exact command before running it")
    parser.add_argument("--check-build", dest="check_build", action="store_true",
                        help="show which frameworks, MPI library, thread level and launchers are available")
    parser.add_argument("-v", "--version", action="store_true", help="print hvdlite's version and exit")
    tuning = parser.add_argument_group("hvdlite settings passed to every rank (as HVDLITE_* variables)")
    tuning.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="fusion buffer size in MiB (0 turns fusion off)")
    tuning.add_argument("--cycle-time-ms", type=float, metavar="MS", help="milliseconds between engine cycles")
    tuning.add_argument("--cache-capacity", type=int, metavar="N", help="response cache entries")
    tuning.add_argument("--timeline-filename", metavar="FILE", help="write a Chrome-trace timeline (rank 0)")
    tuning.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                        help="mark engine cycles in the timeline")
    tuning.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="hvdlite log level")
    tuning.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                        help="warn when a tensor waits this long for other ranks")
    tuning.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                        help="fail when a tensor waits this long for other ranks (0: never)")
    tuning.add_argument("--no-stall-check", action="store_true", default=None, help="turn stall checks off")
    add_elastic_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not (args.check_build or args.version) and not args.command:
        parser.error("give the program to run, e.g.: hvdlite-run -np 2 python train.py")
    return args


def tuning_environment(args: argparse.Namespace) -> dict[str, str]:
    """HVDLITE_* variables for the tuning flags that were given."""
    values: dict[str, str] = {}
    for flag, (setting, scale) in TUNING_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (int, float)):
            scaled = value * scale
            text = str(int(scaled)) if float(scaled).is_integer() else str(scaled)
        else:
            text = str(value)
        values["HVDLITE_" + setting.upper()] = text
    return values


def env_assignments(items: Sequence[str], current: dict[str, str]) -> dict[str, str]:
    """Turn ``-x VAR`` / ``-x VAR=VALUE`` into values; a bare name takes its value from ``current``."""
    values: dict[str, str] = {}
    for item in items:
        for part in filter(None, item.split(",")) if "=" not in item else [item]:
            name, sep, value = part.partition("=")
            name = name.strip()
            if not name.replace("_", "a").isalnum() or name[0].isdigit():
                raise ValueError(f"-x {item!r}: {name!r} is not an environment variable name")
            if sep:
                values[name] = value
            elif name in current:
                values[name] = current[name]
            else:
                raise ValueError(f"-x {name}: {name} is not set here; give a value with -x {name}=VALUE")
    return values


# ---------------------------------------------------------------------------------------------- elastic
#: Flags that make hvdlite-run the elastic driver (hvdlite/run/elastic/, docs/elastic.md).
ELASTIC_FLAGS = ("min_np", "max_np", "host_discovery_script")


def add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    """horovodrun's elastic flags; any of --min-np/--max-np/--host-discovery-script turns elastic mode on."""
    group = parser.add_argument_group("elastic training (restarts the job at a new size; see docs/elastic.md)")
    group.add_argument("--min-np", dest="min_np", type=int, metavar="N",
                       help="fewest processes to run with; wait (--elastic-timeout) while fewer slots are usable")
    group.add_argument("--max-np", dest="max_np", type=int, metavar="N", help="most processes to run with")
    group.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="SCRIPT",
                       help="executable printing the usable hosts, one 'host:slots' a line; run every second")
    group.add_argument("--slots-per-host", dest="slots_per_host", type=int, metavar="K",
                       help="slots of every discovered host (overrides the script's :slots)")
    group.add_argument("--elastic-timeout", dest="elastic_timeout", type=float, default=600.0, metavar="S",
                       help="seconds to wait for --min-np usable slots before giving up (default 600)")
    group.add_argument("--reset-limit", dest="reset_limit", type=int, metavar="R",
                       help="stop (non-zero exit) instead of restarting the job a (R+1)-th time")
    group.add_argument("--blacklist-cooldown-range", dest="blacklist_cooldown_range", type=float, nargs=2,
                       metavar=("LO", "HI"),
                       help="a failed host is excluded for a random LO..HI seconds (default: for good)")


def is_elastic(args: argparse.Namespace) -> bool:
    return any(getattr(args, flag, None) is not None for flag in ELASTIC_FLAGS)
