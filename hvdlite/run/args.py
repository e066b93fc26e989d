"""Command-line flags of hvdlite-run (Horovod's everyday ``horovodrun`` flags plus a few of our own)."""
from __future__ import annotations

import argparse
from typing import Mapping, Optional, Sequence

from ..core.launch import LOG_LEVELS

#: hvdlite-run's tuning flags (argparse dests) and the setting (``HVDLITE_<NAME>``) each one sets in every rank: those
#: named as their setting, then the others (--fusion-threshold-mb is in MiB, its setting in bytes).
TUNING_FLAGS: dict[str, str] = {
    **{name: name for name in ("cycle_time_ms", "cache_capacity", "timeline_mark_cycles", "log_level", "log_hide_time",
                               "autotune", "autotune_log_file", "autotune_warmup_samples", "autotune_steps_per_sample",
                               "autotune_bayes_opt_max_samples", "autotune_gaussian_process_noise")},
    "fusion_threshold_mb": "fusion_threshold_bytes", "timeline_filename": "timeline",
    "stall_check_warning_time_seconds": "stall_check_time_seconds",
    "stall_check_shutdown_time_seconds": "stall_shutdown_time_seconds", "no_stall_check": "stall_check_disable"}

#: What Gloo is in hvdlite (hvdlite-run --check-build's "[X] Gloo"): why --gloo and hvdlite.run(use_gloo=True)
#: are refused, and --gloo-timeout-seconds changes nothing.
GLOO_ROLE = ("hvdlite-run starts the ranks with MPI only (mpiexec, mpirun or srun); Gloo in hvdlite "
             "(--check-build's \"Gloo\") is torch.distributed's gloo, which carries hvdlite.torch's CPU tensors "
             "inside that MPI job (HOROVOD_CPU_OPERATIONS=gloo), not a launcher")
#: horovodrun flags hvdlite accepts but that change nothing here, and why (a warning says so).
NO_EFFECT_FLAGS: dict[str, str] = {
    "hierarchical_allreduce": "hvdlite's allreduce is MPI's own, or NCCL's or gloo's (which pick the algorithm)",
    "hierarchical_allgather": "hvdlite's allgather is MPI's own, or NCCL's or gloo's (which pick the algorithm)",
    "torus_allreduce": "hvdlite's allreduce is MPI's own, or NCCL's or gloo's (which pick the algorithm)",
    "thread_affinity": "hvdlite's engine thread is a Python thread; bind ranks with --binding-args instead",
    "num_nccl_streams": "hvdlite's NCCL plane is torch.distributed's NCCL process group, which keeps its own streams",
    "tcp_flag": "hvdlite-run leaves the transport to MPI; choose it with --mpi-args or --network-interfaces",
    "mpi_threads_disable": "hvdlite needs MPI_THREAD_MULTIPLE for its engine thread",
    "gloo_timeout_seconds": GLOO_ROLE,
    "ccl_bgt_affinity": "hvdlite does not use oneCCL",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdlite-run", allow_abbrev=False,
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
    parser.add_argument("--launcher", choices=("auto", "mpich", "openmpi", "srun"), default="auto",
                        help="which launcher to drive (default: srun inside a Slurm allocation, else the "
                             "mpiexec/mpirun that matches the MPI library mpi4py loads)")
    parser.add_argument("--srun-mpi", dest="srun_mpi", metavar="PLUGIN",
                        help="srun --mpi plugin (default: pmi2 for MPICH-based MPI, pmix for Open MPI)")
    parser.add_argument("--verbose", action="store_true", help="print the exact command before running it")
    sentinel = parser.add_mutually_exclusive_group()
    sentinel.add_argument("--launch-sentinel", dest="launch_sentinel", action="store_true", default=None,
                          help="start each rank under a small sentinel process that names the rank when a "
                               "signal kills it (default; env HVDLITE_LAUNCH_SENTINEL)")
    sentinel.add_argument("--no-launch-sentinel", dest="launch_sentinel", action="store_false", default=None,
                          help="start the ranks' programs directly (the launcher then names no dead rank)")
    parser.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                        help="show which frameworks, MPI library, thread level and launchers are available")
    parser.add_argument("-v", "--version", action="store_true", help="print hvdlite's version and exit")
    tuning = parser.add_argument_group("hvdlite settings passed to every rank (as HVDLITE_* variables)")
    tuning.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="fusion buffer size in MiB (0 turns fusion off)")
    tuning.add_argument("--cycle-time-ms", type=float, metavar="MS", help="milliseconds between engine cycles")
    tuning.add_argument("--cache-capacity", type=int, metavar="N", help="response cache entries")
    tuning.add_argument("--timeline-filename", metavar="FILE", help="write a Chrome-trace timeline (rank 0)")
    tuning.add_argument("--timeline-mark-cycles", action=argparse.BooleanOptionalAction,
                        help="mark engine cycles in the timeline (or not)")
    tuning.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="hvdlite log level")
    stamps = tuning.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", dest="log_hide_time", action="store_false", default=None,
                        help="start hvdlite's log lines with the time")
    stamps.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_hide_time",
                        action="store_true", default=None, help="leave the time out of hvdlite's log lines")
    stamps.add_argument("--no-log-hide-timestamp", dest="log_hide_time", action="store_false", default=None,
                        help="the same as --log-with-timestamp (horovodrun's name for it)")
    tuning.add_argument("--stall-check-warning-time-seconds", type=float, metavar="S",
                        help="warn when a tensor waits this long for other ranks")
    tuning.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="S",
                        help="fail when a tensor waits this long for other ranks (0: never)")
    tuning.add_argument("--no-stall-check", action="store_true", default=None, help="turn stall checks off")
    tuning.add_argument("--stall-check", dest="no_stall_check", action="store_false", default=None,
                        help="turn stall checks on (the default)")
    add_horovodrun_flags(parser)
    add_elastic_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def add_horovodrun_flags(parser: argparse.ArgumentParser) -> None:
    """The rest of horovodrun's flags, so its command lines run unchanged (see docs in README, Launching)."""
    group = parser.add_argument_group("horovodrun flags")
    controller = group.add_mutually_exclusive_group()
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", help="accepted: hvdlite always uses MPI")
    controller.add_argument("--gloo", dest="use_gloo", action="store_true", help="refused: hvdlite has no Gloo")
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true",
                            help="refused: hvdlite-run does not drive IBM LSF's jsrun (use mpirun in the allocation)")
    group.add_argument("--network-interfaces", "--network-interface", dest="nics", action="append",
                       metavar="NIC[,NIC...]", help="network interfaces for MPI traffic between hosts, e.g. "
                       "eth0,ib0 (repeatable); all are given to MPI")
    group.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, metavar="PORT",
                       help="ssh port of the hosts (mpiexec/mpirun start remote ranks over ssh)")
    group.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
                       help="ssh private key for the hosts")
    group.add_argument("--start-timeout", dest="start_timeout", type=int, metavar="S",
                       help="seconds ssh may take to reach each host (ssh ConnectTimeout)")
    group.add_argument("--output-filename", dest="output_filename", metavar="DIR",
                       help="also write each rank's output to DIR/rank.<rank>/stdout and stderr")
    group.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                       action="store_true", help="start every output line with the time, rank and stream")
    group.add_argument("--disable-cache", dest="disable_cache", action="store_true",
                       help="accepted: hvdlite-run caches no host checks")
    group.add_argument("--config-file", dest="config_file", metavar="FILE",
                       help="horovodrun's YAML settings file; flags on the command line win over it")
    group.add_argument("--binding-args", dest="binding_args", metavar='"ARGS"',
                       help='process binding arguments for the MPI launcher, replacing hvdlite-run\'s '
                            '(Open MPI: --bind-to none), e.g. --binding-args="--bind-to core"')
    for flag in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce", "mpi-threads-disable"):
        dest = flag.replace("-", "_")
        switch = group.add_mutually_exclusive_group()
        switch.add_argument(f"--{flag}", dest=dest, action="store_true", default=None, help="no effect in hvdlite")
        switch.add_argument(f"--no-{flag}", dest=dest, action="store_false", default=None, help="no effect in hvdlite")
    group.add_argument("--thread-affinity", dest="thread_affinity", type=int, help="no effect in hvdlite")
    group.add_argument("--num-nccl-streams", dest="num_nccl_streams", type=int, help="no effect in hvdlite")
    group.add_argument("--gloo-timeout-seconds", dest="gloo_timeout_seconds", type=int, help="no effect in hvdlite")
    group.add_argument("--tcp", dest="tcp_flag", action="store_true", default=None, help="no effect in hvdlite")
    tune = parser.add_argument_group("autotune (Bayesian optimisation of the engine's settings while training "
                                     "runs; needs pip install 'hvdlite[autotune]')")
    tune.add_argument("--autotune", action=argparse.BooleanOptionalAction, help="tune --fusion-threshold-mb, "
                      "--cycle-time-ms and the chunk size while training runs (or not: the default)")
    tune.add_argument("--autotune-log-file", dest="autotune_log_file", metavar="FILE",
                      help="CSV log (rank 0): one line per sample and the final choice")
    tune.add_argument("--autotune-warmup-samples", dest="autotune_warmup_samples", type=int, metavar="N",
                      help="samples discarded first (default 3)")
    tune.add_argument("--autotune-steps-per-sample", dest="autotune_steps_per_sample", type=int, metavar="N",
                      help="training steps per sample (default 10)")
    tune.add_argument("--autotune-bayes-opt-max-samples", dest="autotune_bayes_opt_max_samples", type=int,
                      metavar="N", help="samples scored before the best is kept (default 20)")
    tune.add_argument("--autotune-gaussian-process-noise", dest="autotune_gaussian_process_noise", type=float,
                      metavar="X", help="noise the Gaussian process assumes in each score (default 0.8)")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse hvdlite-run's command line (and --config-file); exit 2 with the reason on a refused flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    nics = (nic.strip() for given in args.nics or () for nic in given.split(","))  # in order, each once
    args.nics = list(dict.fromkeys(nic for nic in nics if nic))
    args.config_notes = []
    if args.config_file:
        from .config_file import ConfigFileError, apply_config_file
        try:
            args.config_notes = apply_config_file(args, args.config_file)
        except ConfigFileError as exc:
            parser.error(str(exc))
    if args.use_gloo:  # one line: the usage is not what went wrong
        parser.exit(2, f"{parser.prog}: error: --gloo: {GLOO_ROLE}. Drop --gloo (or give --mpi)\n")
    if not (args.check_build or args.version) and not args.command:
        parser.error("give the program to run, e.g.: hvdlite-run -np 2 python train.py")
    return args


def jsrun_refusal(env: Mapping[str, str]) -> str:
    """Why horovodrun's --jsrun cannot run here: outside IBM LSF there is no jsrun allocation, and inside
    one hvdlite-run still starts the ranks with mpirun (which reads the LSF allocation)."""
    job = env.get("LSB_JOBID")
    if not job:
        return ("--jsrun: jsrun starts processes inside an IBM LSF allocation, and this is not one (LSB_JOBID is "
                "not set). Drop --jsrun: hvdlite-run starts the ranks with mpiexec, mpirun or srun")
    return (f"--jsrun: hvdlite-run does not drive jsrun; in this LSF allocation (job {job}) drop --jsrun and run "
            f"hvdlite-run -np N ... (--launcher openmpi: Open MPI's mpirun reads the LSF allocation)")


def no_effect_warnings(args: argparse.Namespace) -> list[str]:
    """A warning for each given horovodrun flag that changes nothing in hvdlite."""
    warnings = []
    for name, reason in NO_EFFECT_FLAGS.items():
        # --no-hierarchical-allreduce and kin ask for what hvdlite does anyway: nothing to warn about
        if getattr(args, name, None) not in (None, False):
            warnings.append(f"--{name.replace('_flag', '').replace('_', '-')} has no effect: {reason}")
    return warnings


def tuning_environment(args: argparse.Namespace) -> dict[str, str]:
    """HVDLITE_* variables for the tuning flags that were given."""
    from ..core.launch import Config
    values: dict[str, str] = {}
    for flag, setting in TUNING_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (int, float)):
            scaled = value * (1024 * 1024 if flag == "fusion_threshold_mb" else 1)
            text = str(int(scaled)) if float(scaled).is_integer() else str(scaled)
        else:
            text = str(value)
        values[Config.env_keys(setting)[0]] = text
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


def add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    """horovodrun's elastic flags; any of --min-np/--max-np/--host-discovery-script turns elastic mode on."""
    group = parser.add_argument_group("elastic training (restarts the job at a new size; see docs/elastic.md)")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                       help="fewest processes to run with; wait (--elastic-timeout) while fewer slots are usable")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="most processes to run with")
    group.add_argument("--host-discovery-script", dest="host_discovery_script", metavar="SCRIPT",
                       help="executable printing the usable hosts, one 'host:slots' a line; run every second")
    group.add_argument("--slots-per-host", dest="slots_per_host", type=int, metavar="K",
                       help="slots of every discovered host (overrides the script's :slots)")
    group.add_argument("--elastic-timeout", dest="elastic_timeout", type=float, default=600.0, metavar="S",
                       help="seconds to wait for --min-np usable slots before giving up (default 600)")
    group.add_argument("--reset-limit", dest="reset_limit", type=int, metavar="R",
                       help="stop (non-zero exit) instead of restarting the job a (R+1)-th time (in-process "
                            "elastic mode: instead of recovering a (R+1)-th time; ranks lost together are one)")
    group.add_argument("--blacklist-cooldown-range", dest="blacklist_cooldown_range", type=float, nargs=2,
                       metavar=("LO", "HI"),
                       help="a failed host is excluded for a random LO..HI seconds (default: for good)")
    group.add_argument("--elastic-mode", dest="elastic_mode", choices=("auto", "in-process", "restart"),
                       default="auto",
                       help="in-process: survivors of a lost rank recover in their own processes (needs Open MPI "
                            "5 with ULFM: started with --with-ft ulfm over TCP); restart: the job is started "
                            "again from its last commit; auto (default): in-process where the MPI allows it")


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether hvdlite-run is the elastic driver (hvdlite/run/elastic/, docs/elastic.md): see add_elastic_flags."""
    return any(getattr(args, flag, None) is not None for flag in ("min_np", "max_np", "host_discovery_script"))
