"""hvdlite-run on this machine: flags, command building for each launcher, real runs, errors, Ctrl-C."""
from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from conftest import make_child_venv
from cluster.fixtures import (PYTHON, WORKERS, assert_ctrl_c_stops_every_rank, assert_kill_9_takes_the_job,
                              assert_topology, base_env,
                              run, topology)
from hvdlite.run.args import TUNING_FLAGS, env_assignments, jsrun_refusal, parse_args, tuning_environment
from hvdlite.run.commands import Plan, build_command, child_environment
from hvdlite.run.hosts import Host, HostSpecError, check_slots, cpus_per_node_total, parse_hostfile, parse_hosts
from hvdlite.run.launchers import MPICH, OPENMPI, SRUN, Launcher, choose_srun_mpi, library_family, MPILibrary

TOPOLOGY = str(WORKERS / "launch_topology.py")
RUN = [PYTHON, "-m", "hvdlite.run"]


# ------------------------------------------------------------------------------------------------ parsing
def test_hosts_and_hostfile_parsing(tmp_path: Path) -> None:
    assert parse_hosts("h1:2,h2:2") == [Host("h1", 2), Host("h2", 2)]
    assert parse_hosts("node-a,node-b:3,node-a:1") == [Host("node-a", 2), Host("node-b", 3)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nh1 slots=4\nh2:2  # comment\n\nh3\nh4 max_slots=8\n")
    assert parse_hostfile(hostfile) == [Host("h1", 4), Host("h2", 2), Host("h3", 1), Host("h4", 8)]
    for bad, message in (("h1:x", "whole number"), ("h1:0", "at least 1 slot"), (",", "names no host")):
        with pytest.raises(HostSpecError, match=message):
            parse_hosts(bad)
    with pytest.raises(HostSpecError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "missing")
    with pytest.raises(HostSpecError, match=r"asked for 5 processes .* only 4 slots \(h1:2,h2:2\)"):
        check_slots(5, parse_hosts("h1:2,h2:2"))
    check_slots(4, parse_hosts("h1:2,h2:2"))
    assert cpus_per_node_total("4(x2),2") == 10


def test_flags_and_settings() -> None:
    args = parse_args(["-np", "4", "-H", "a:2,b:2", "-x", "A", "--env", "B=2", "--mpi-args=-l -v",
                       "--fusion-threshold-mb", "8", "--cycle-time-ms", "2.5", "--timeline-filename", "/t.json",
                       "--no-stall-check", "--verbose", "python", "train.py", "--epochs", "3"])
    assert (args.num_proc, args.hosts, args.verbose) == (4, "a:2,b:2", True)
    assert args.command == ["python", "train.py", "--epochs", "3"]
    assert env_assignments(args.env, {"A": "1"}) == {"A": "1", "B": "2"}
    with pytest.raises(ValueError, match="A is not set here"):
        env_assignments(["A"], {})
    assert tuning_environment(args) == {"HVDLITE_FUSION_THRESHOLD": str(8 * 1024 * 1024),
                                        "HVDLITE_CYCLE_TIME": "2.5", "HVDLITE_TIMELINE": "/t.json",
                                        "HVDLITE_STALL_CHECK_DISABLE": "1"}
    from hvdlite.core.config import Config
    assert set(TUNING_FLAGS.values()) <= set(Config.field_names())


def test_command_for_each_launcher() -> None:
    plan = Plan(num_proc=4, command=["python", "t.py"], hosts=parse_hosts("h1:2,h2:2"),
                extra_env={"FOO": "1"}, mpi_args=["-v"], network_interfaces=["eth1"], is_root=True)
    mpich = Launcher(MPICH, "/bin/mpiexec", "HYDRA 5")
    assert build_command(mpich, plan, {}) == [
        "/bin/mpiexec", "-n", "4", "-hosts", "h1:2,h2:2", "-iface", "eth1", "-genv", "FOO", "1", "-genv",
        "UCX_NET_DEVICES", "eth1", "-v", "python", "t.py"]
    ompi = Launcher(OPENMPI, "/bin/mpirun", "Open MPI 5")
    env = child_environment({"PATH": "/bin", "HVDLITE_CYCLE_TIME": "2", "OTHER": "x"}, plan, ompi)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert build_command(ompi, plan, env) == [
        "/bin/mpirun", "--allow-run-as-root", "-np", "4", "-H", "h1:2,h2:2", "--bind-to", "none",
        "--map-by", "slot", "--mca", "btl_tcp_if_include", "eth1", "--mca", "oob_tcp_if_include", "eth1",
        "--noprefix", "-x", "FOO", "-x", "HVDLITE_CYCLE_TIME", "-x", "HVDLITE_LAUNCHED_BY", "-x", "PATH", "-v",
        "python", "t.py"]
    local = Plan(num_proc=3, command=["p"], is_root=False)
    assert build_command(ompi, local, {})[:4] == ["/bin/mpirun", "-np", "3", "-H"]
    assert "localhost:3" in build_command(ompi, local, {})
    # --noprefix: the ranks' PATH is the user's (Open MPI 4 by its absolute path would put its bin/ first), except
    # for a multi-host job of an Open MPI outside the system's bin/ (its orted is found through the prefix) or a
    # user's own --prefix/--noprefix
    module = Launcher(OPENMPI, "/opt/openmpi-4.1/bin/mpirun", "Open MPI 4.1.6")
    assert "--noprefix" in build_command(module, local, {}) and "--noprefix" not in build_command(module, plan, {})
    own = Plan(num_proc=3, command=["p"], mpi_args=["--prefix", "/opt/o"])
    assert "--noprefix" not in build_command(ompi, own, {})
    srun = Launcher(SRUN, "/usr/bin/srun", "slurm 22.05")
    assert build_command(srun, Plan(num_proc=2, command=["p"], srun_mpi="pmix", in_slurm=True), {}) == [
        "/usr/bin/srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", "--export=ALL", "p"]
    mpich_lib = MPILibrary(library_family("MPICH Version: 5.0.2"), "MPICH 5.0.2")
    ompi_lib = MPILibrary(library_family("Open MPI v5.0.11, package: Open MPI"), "Open MPI 5.0.11")
    assert choose_srun_mpi(mpich_lib, ["pmix", "none", "pmi2"]) == "pmi2"
    assert choose_srun_mpi(ompi_lib, ["pmix", "none", "pmi2"]) == "pmix"
    with pytest.raises(RuntimeError, match="no PMI plugin"):
        choose_srun_mpi(ompi_lib, ["none"])


def test_the_program_is_resolved_as_the_users_shell_would(tmp_path: Path) -> None:
    """The program name becomes the first match on the user's PATH (a venv's bin/ before /usr/bin), symlinks
    kept (a venv's python is a symlink to the base interpreter); a path or an unknown name is left alone."""
    from hvdlite.run.commands import resolve_program
    venv_bin, system_bin = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    for directory in (venv_bin, system_bin):
        directory.mkdir(parents=True)
        (directory / "python3").symlink_to(PYTHON)
    path = os.pathsep.join([str(venv_bin), str(system_bin)])
    assert resolve_program(["python3", "t.py"], {"PATH": path}) == [str(venv_bin / "python3"), "t.py"]
    assert resolve_program(["./t.sh", "-v"], {"PATH": path}) == ["./t.sh", "-v"]
    assert resolve_program(["no-such-program"], {"PATH": path}) == ["no-such-program"]


# --------------------------------------------------------------------------------------------- real runs
def test_hvdlite_run_np_verbose_env(nproc: int) -> None:
    """`hvdlite-run -np N -x VAR=... --verbose` runs N real ranks with the right topology and environment."""
    proc = run([*RUN, "-np", str(nproc), "--verbose", "-x", "HVDT_FLAG=on", "--cycle-time-ms", "2",
                PYTHON, TOPOLOGY, "--env", "HVDT_FLAG,HVDLITE_CYCLE_TIME,HVDLITE_LAUNCHED_BY"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    running = [line for line in proc.stdout.splitlines() if line.startswith("hvdlite-run: running: ")]
    assert len(running) == 1, proc.stdout
    assert f" -n {nproc} " in running[0] and "mpiexec" in running[0] and TOPOLOGY in running[0]
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=1, per_host=nproc)
    for r in ranks:
        assert r["env"] == {"HVDT_FLAG": "on", "HVDLITE_CYCLE_TIME": "2", "HVDLITE_LAUNCHED_BY": "hvdlite-run/mpich"}


def test_console_script_and_exit_code() -> None:
    """The installed `hvdlite-run` console script runs the job and exits with the job's exit code."""
    script = shutil.which("hvdlite-run", path=base_env()["PATH"])
    assert script is not None, "hvdlite-run is not installed: pip install -e ."
    proc = run([script, "-np", "2", PYTHON, TOPOLOGY, "--exit-code", "7", "--exit-rank", "1"], timeout=120)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert_topology(topology(proc.stdout), hosts=1, per_host=2)


def test_mpi_args_are_passed_through() -> None:
    """--mpi-args reaches mpiexec: hydra's -prepend-rank labels every output line with its rank."""
    proc = run([*RUN, "-np", "2", "--mpi-args=-prepend-rank", PYTHON, "-c", "print('hello')"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    # unbuffered Python writes "hello" and "\n" apart, and hydra labels each piece
    assert sorted(set(re.findall(r"\[(\d+)\] hello", proc.stdout))) == ["0", "1"], proc.stdout


def test_hostfile_gives_hosts_and_process_count(tmp_path: Path) -> None:
    """--hostfile without -np: one rank per slot."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=3  # this machine\n")
    proc = run([*RUN, "--verbose", "--hostfile", str(hostfile), PYTHON, TOPOLOGY], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " -n 3 -hosts localhost:3 " in proc.stdout, proc.stdout
    assert_topology(topology(proc.stdout), hosts=1, per_host=3)


def test_too_many_slots_is_refused() -> None:
    proc = run([*RUN, "-np", "5", "-H", "localhost:2,127.0.0.1:2", PYTHON, TOPOLOGY], timeout=60)
    assert proc.returncode == 2
    assert "asked for 5 processes (-np 5) but the hosts give only 4 slots" in proc.stderr


def test_np_below_one_is_refused_inside_a_slurm_allocation_too() -> None:
    """-np 0 inside an allocation went on to the launcher; it is refused there as everywhere else."""
    from hvdlite.run.__main__ import plan_launch
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}
    with pytest.raises(HostSpecError, match="-np must be at least 1, got 0"):
        plan_launch(parse_args(["--launcher", "mpich", "-np", "0", "python", "x.py"]), env)
    with pytest.raises(HostSpecError, match=r"asked for 5 processes \(-np 5\) but Slurm job 7 has only 4 tasks"):
        plan_launch(parse_args(["--launcher", "mpich", "-np", "5", "python", "x.py"]), env)


def test_no_launcher_found(tmp_path: Path) -> None:
    """With no mpiexec/mpirun next to Python or on PATH, hvdlite-run says so and how to fix it."""
    python = make_child_venv(tmp_path / "venv")
    empty = tmp_path / "bin"  # not /usr/bin: a distribution's MPI (apt's openmpi-bin) may live there
    empty.mkdir()
    env = base_env(PATH=str(empty))
    env.pop("SLURM_JOB_ID", None)
    env.pop("SLURM_JOBID", None)
    proc = run([str(python), "-m", "hvdlite.run", "-np", "2", "python", "x.py"], env=env,
               timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no MPI launcher found" in proc.stderr and "pip install mpich" in proc.stderr


def test_check_build() -> None:
    proc = run([*RUN, "--check-build"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    import importlib.util
    for name, module in (("PyTorch", "torch"), ("TensorFlow", "tensorflow")):
        box = "[X]" if importlib.util.find_spec(module) else "[ ]"
        assert f"{box} {name}" in out, out
    assert "Keras 3" in out
    from mpi4py import MPI  # the test process may load MPI; compare with what the launcher reports
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert f"[X] MPI: {library}" in out, out
    assert "MPI thread level: MPI_THREAD_MULTIPLE" in out, out
    # the build flags a training script sees (the torch frontend's, when torch is here), not the bare core's
    if importlib.util.find_spec("torch"):
        import hvdlite.torch as hvd
    else:
        import hvdlite as hvd  # type: ignore[no-redef]
    controllers = out.split("Available controllers:")[1].split("MPI thread level")[0]
    assert f"{'[X]' if hvd.gloo_built() else '[ ]'} Gloo" in controllers, out
    operations = out.split("Available tensor operations:")[1].split("Launchers:")[0]
    for name in ("NCCL", "Gloo"):
        assert f"{'[X]' if getattr(hvd, name.lower() + '_built')() else '[ ]'} {name}" in operations, out
    assert "[X] MPICH hydra mpiexec" in out or "[X] Open MPI" in out, out


def assert_one_clean_line_per_rank(out: str, ranks: int = 2) -> None:
    """Ctrl-C under hvdlite-run: each rank says it was interrupted in one line; no traceback, no rank
    reported as killed (the sentinels forwarded the stop), no failing excepthook."""
    lines = re.findall(r"^\[hvdlite rank (\d+)\] interrupted \(KeyboardInterrupt at \S+launch_sleep\.py:\d+\); "
                       r"stopping$", out, re.M)
    assert sorted(lines) == [str(r) for r in range(ranks)], out
    for text in ("Traceback", "Error in sys.excepthook", "KeyboardInterrupt:", "was killed by signal", "Killed"):
        assert text not in out, out


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    """SIGINT to hvdlite-run (a terminal's Ctrl-C) stops every rank, one line each, and exits 130."""
    assert_one_clean_line_per_rank(assert_ctrl_c_stops_every_rank([*RUN, "-np", "2"], base_env(), tmp_path))


def test_sigterm_stops_every_rank(tmp_path: Path) -> None:
    """SIGTERM to hvdlite-run (kill, a batch system's stop) stops every rank, sentinels and programs alike,
    and exits 143; no rank is reported as killed, since the job was asked to stop."""
    out = assert_ctrl_c_stops_every_rank([*RUN, "-np", "2"], base_env(), tmp_path, sig=signal.SIGTERM)
    assert "was killed by signal" not in out and "Traceback" not in out, out


def test_kill_9_of_hvdlite_run_takes_the_job(tmp_path: Path) -> None:
    """kill -9 of hvdlite-run (a timeout's SIGKILL) leaves no mpiexec, hydra proxy, sentinel or rank behind."""
    assert_kill_9_takes_the_job([*RUN, "-np", "2"], base_env(), tmp_path)


def test_exit_code_passes_through_the_sentinel_and_is_reported_with_the_rank() -> None:
    """A rank's own exit code is the job's exit code under the sentinel, with one line naming that rank;
    with --no-launch-sentinel (or HVDLITE_LAUNCH_SENTINEL=0) the program runs directly: no sentinel line."""
    proc = run([*RUN, "-np", "2", PYTHON, TOPOLOGY, "--exit-code", "5", "--exit-rank", "1"], timeout=120)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert re.findall(r"hvdlite-run: rank (\d) \(pid \d+ on host \S+\) exited with code (\d+)", proc.stderr) == \
        [("1", "5")], proc.stderr
    for flags, env in ((["--no-launch-sentinel"], base_env()), ([], base_env(HVDLITE_LAUNCH_SENTINEL="0"))):
        proc = run([*RUN, "-np", "2", *flags, "--verbose", PYTHON, TOPOLOGY, "--exit-code", "5", "--exit-rank", "1"],
                   timeout=120, env=env)
        assert proc.returncode == 5, proc.stdout + proc.stderr
        assert "exited with code" not in proc.stderr and "sentinel.py" not in proc.stdout, proc.stdout + proc.stderr
    proc = run([*RUN, "-np", "1", "--verbose", PYTHON, TOPOLOGY], timeout=120)
    assert proc.returncode == 0 and "sentinel.py -- " in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ horovodrun command lines
def test_no_prefix_matching_and_mpi_is_a_no_op() -> None:
    """`--mpi` is horovodrun's controller flag, not an abbreviation of --mpi-args swallowing the program."""
    args = parse_args(["-np", "2", "--mpi", "python", "train.py"])
    assert (args.use_mpi, args.mpi_args, args.command) == (True, "", ["python", "train.py"])
    assert parse_args(["-cb"]).check_build is True
    for abbreviated in (["--fusion-thr", "8"], ["--verb"], ["--mpi-a=-l"]):
        with pytest.raises(SystemExit) as info:
            parse_args(["-np", "2", *abbreviated, "python", "t.py"])
        assert info.value.code == 2


def test_real_launch_with_mpi_flag() -> None:
    proc = run([*RUN, "-np", "2", "--mpi", PYTHON, TOPOLOGY], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_topology(topology(proc.stdout), hosts=1, per_host=2)


@pytest.mark.parametrize("flags, message", [
    (["--gloo"], "hvdlite-run: error: --gloo: hvdlite-run starts the ranks with MPI only (mpiexec, mpirun or srun); "
                 "Gloo in hvdlite (--check-build's \"Gloo\") is torch.distributed's gloo, which carries "
                 "hvdlite.torch's CPU tensors inside that MPI job (HOROVOD_CPU_OPERATIONS=gloo), not a launcher. "
                 "Drop --gloo (or give --mpi)"),
])
def test_refused_flags_say_why(flags: list, message: str) -> None:
    """One line, the reason (no usage before it), consistent with --check-build's "[X] Gloo"."""
    proc = run([*RUN, "-np", "2", *flags, PYTHON, TOPOLOGY], timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == message + "\n"
    assert proc.stdout == ""


def test_every_accepted_flag_is_in_help() -> None:
    """Each horovodrun flag hvdlite-run accepts (HOROVODRUN_FLAGS, --gloo refused) is listed by --help."""
    proc = run([*RUN, "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    flags = [values[0].split("=")[0] for values in HOROVODRUN_FLAGS if values[0] != "--gloo"]
    missing = [flag for flag in flags if not re.search(rf"(^|[\s,\[|]){re.escape(flag)}(?![\w-])", proc.stdout)]
    assert missing == [], missing


def test_horovod_settings_flags() -> None:
    args = parse_args(["-np", "2", "--log-level", "trace", "--no-timeline-mark-cycles", "--log-with-timestamp",
                       "--stall-check", "python", "t.py"])
    assert tuning_environment(args) == {"HVDLITE_LOG_LEVEL": "TRACE", "HVDLITE_TIMELINE_MARK_CYCLES": "0",
                                        "HVDLITE_LOG_HIDE_TIME": "0", "HVDLITE_STALL_CHECK_DISABLE": "0"}
    args = parse_args(["-np", "2", "--log-level", "FATAL", "--log-without-timestamp", "python", "t.py"])
    assert tuning_environment(args) == {"HVDLITE_LOG_LEVEL": "FATAL", "HVDLITE_LOG_HIDE_TIME": "1"}
    with pytest.raises(SystemExit):
        parse_args(["-np", "2", "--log-level", "verbose", "python", "t.py"])


#: Every flag of horovodrun 0.28 (horovod/runner/launch.py's parser) with a value it accepts.
HOROVODRUN_FLAGS = [
    ["-np", "2"], ["--num-proc", "2"], ["--disable-cache"], ["--start-timeout", "30"],
    ["--network-interfaces", "lo"], ["--network-interface", "lo"], ["--output-filename", "/tmp/o"], ["--verbose"],
    ["--config-file", "/dev/null"], ["-p", "22"], ["--ssh-port", "22"], ["-i", "/k"], ["--ssh-identity-file", "/k"],
    ["--fusion-threshold-mb", "32"], ["--cycle-time-ms", "2"], ["--cache-capacity", "512"],
    ["--hierarchical-allreduce"], ["--no-hierarchical-allreduce"], ["--hierarchical-allgather"],
    ["--no-hierarchical-allgather"], ["--autotune"], ["--no-autotune"], ["--autotune-log-file", "/tmp/a.csv"],
    ["--autotune-warmup-samples", "1"], ["--autotune-steps-per-sample", "2"],
    ["--autotune-bayes-opt-max-samples", "3"], ["--autotune-gaussian-process-noise", "0.5"],
    ["--min-np", "1"], ["--min-num-proc", "1"], ["--max-np", "4"], ["--max-num-proc", "4"],
    ["--slots-per-host", "2"], ["--elastic-timeout", "60"], ["--reset-limit", "3"],
    ["--blacklist-cooldown-range", "10", "20"], ["--timeline-filename", "/tmp/t.json"], ["--timeline-mark-cycles"],
    ["--no-timeline-mark-cycles"], ["--no-stall-check"], ["--stall-check"], ["--stall-check-warning-time-seconds", "5"],
    ["--stall-check-shutdown-time-seconds", "9"], ["--mpi-threads-disable"], ["--no-mpi-threads-disable"],
    ["--mpi-args=-v"], ["--tcp"], ["--binding-args=--bind-to core"], ["--num-nccl-streams", "2"],
    ["--thread-affinity", "1"], ["--gloo-timeout-seconds", "30"], ["--log-level", "INFO"], ["--log-with-timestamp"],
    ["--log-without-timestamp"], ["-prefix-timestamp"], ["--prefix-output-with-timestamp"],
    ["--log-hide-timestamp"], ["--no-log-hide-timestamp"], ["-H", "localhost:2"], ["--hosts", "localhost:2"],
    ["-hostfile", "/tmp/h"], ["--hostfile", "/tmp/h"], ["--host-discovery-script", "/bin/true"], ["--gloo"],
    ["--mpi"], ["--jsrun"],
]


def test_every_horovodrun_flag_is_accepted() -> None:
    """horovodrun command lines run unchanged: each of its flags parses (--gloo and --jsrun are refused with
    the reason, not as unrecognized arguments: see test_refused_flags_say_why, test_jsrun_is_refused...)."""
    for values in HOROVODRUN_FLAGS:
        if values[0] == "--gloo":
            continue
        assert parse_args([*values, "python", "t.py"]).command == ["python", "t.py"], values
    args = parse_args(["-np", "2", "--min-num-proc", "1", "--max-num-proc", "3", "--no-log-hide-timestamp", "p"])
    assert (args.min_np, args.max_np, args.log_hide_time) == (1, 3, False)


def test_jsrun_is_refused_with_the_reason() -> None:
    """--jsrun outside IBM LSF is refused before anything starts, saying why; inside LSF it says what to use."""
    proc = run([*RUN, "-np", "2", "--jsrun", PYTHON, TOPOLOGY], timeout=60, env=base_env(LSB_JOBID=""))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("hvdlite-run: error: --jsrun: jsrun starts processes inside an IBM LSF "
                                   "allocation, and this is not one (LSB_JOBID is not set). Drop --jsrun: "
                                   "hvdlite-run starts the ranks with mpiexec, mpirun or srun"), proc.stderr
    assert "in this LSF allocation (job 77) drop --jsrun" in jsrun_refusal({"LSB_JOBID": "77"})


def test_flags_without_effect_warn_and_run() -> None:
    """A horovodrun flag that asks for something hvdlite does not do warns; its --no- form (asking for what
    hvdlite does anyway) runs silently."""
    proc = run([*RUN, "-np", "2", "--hierarchical-allreduce", "--no-hierarchical-allgather", "--thread-affinity",
                "1", "--num-nccl-streams", "2", "--tcp", "--disable-cache", "--no-mpi-threads-disable", PYTHON,
                TOPOLOGY], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("hvdlite-run: warning:")]
    assert warnings == [
        "hvdlite-run: warning: --hierarchical-allreduce has no effect: hvdlite's allreduce is MPI's own, or NCCL's "
        "or gloo's (which pick the algorithm)",
        "hvdlite-run: warning: --thread-affinity has no effect: hvdlite's engine thread is a Python thread; bind "
        "ranks with --binding-args instead",
        "hvdlite-run: warning: --num-nccl-streams has no effect: hvdlite's NCCL plane is torch.distributed's NCCL "
        "process group, which keeps its own streams",
        "hvdlite-run: warning: --tcp has no effect: hvdlite-run leaves the transport to MPI; choose it with "
        "--mpi-args or --network-interfaces"]
    assert_topology(topology(proc.stdout), hosts=1, per_host=2)


def test_network_interfaces_ssh_and_binding_reach_each_launcher() -> None:
    from hvdlite.run.commands import ssh_arguments
    args = parse_args(["-np", "4", "--network-interfaces", "eth0,ib0", "--network-interface", "eth2",
                       "--network-interface", "eth0", "-p", "2222", "-i", "/k/id", "--start-timeout", "40",
                       "python", "t.py"])
    assert args.nics == ["eth0", "ib0", "eth2"]
    ssh = ssh_arguments(args.ssh_port, args.ssh_identity_file, args.start_timeout)
    assert ssh == ["-p", "2222", "-i", "/k/id", "-o", "ConnectTimeout=40"]
    plan = Plan(num_proc=4, command=["p"], hosts=parse_hosts("h1:2,h2:2"), network_interfaces=args.nics,
                ssh_args=ssh, binding_args=["--bind-to", "core"])
    mpich = Launcher(MPICH, "/bin/mpiexec", "HYDRA 5")
    env = child_environment({}, plan, mpich)
    assert env["HYDRA_LAUNCHER_EXTRA_ARGS"] == "-p 2222 -i /k/id -o ConnectTimeout=40"
    assert build_command(mpich, plan, env) == [
        "/bin/mpiexec", "-n", "4", "-hosts", "h1:2,h2:2", "-iface", "eth0", "-launcher", "ssh",
        "-genv", "UCX_NET_DEVICES", "eth0,ib0,eth2", "--bind-to", "core", "p"]
    ompi = Launcher(OPENMPI, "/bin/mpirun", "Open MPI 5")
    assert build_command(ompi, plan, {}) == [
        "/bin/mpirun", "-np", "4", "-H", "h1:2,h2:2", "--bind-to", "core",
        "--mca", "btl_tcp_if_include", "eth0,ib0,eth2", "--mca", "oob_tcp_if_include", "eth0,ib0,eth2",
        "--mca", "plm_rsh_args", "-p 2222 -i /k/id -o ConnectTimeout=40", "--noprefix", "-x", "HVDLITE_LAUNCHED_BY",
        "p"]


def test_ssh_flags_on_a_local_run() -> None:
    """-p/-i/--start-timeout: hydra gets its ssh launcher and the options; local ranks still start."""
    proc = run([*RUN, "-np", "2", "--verbose", "-p", "2222", "-i", "/nonexistent/key", "--start-timeout", "5",
                PYTHON, TOPOLOGY], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HYDRA_LAUNCHER_EXTRA_ARGS='-p 2222 -i /nonexistent/key -o ConnectTimeout=5'" in proc.stdout
    assert " -n 2 -launcher ssh " in proc.stdout
    assert_topology(topology(proc.stdout), hosts=1, per_host=2)


OUTPUT_PROGRAM = ("import os, sys; r = os.environ.get('PMI_RANK'); print('out', r); print('line two', r); "
                  "print('err', r, file=sys.stderr); sys.stdout.write('no newline ' + r)")


def test_output_filename_writes_one_log_per_rank(tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "logs"
    proc = run([*RUN, "-np", str(nproc), "--output-filename", str(out), PYTHON, "-c", OUTPUT_PROGRAM], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"rank.{r}" for r in range(nproc)]
    for r in range(nproc):
        assert sorted(p.name for p in (out / f"rank.{r}").iterdir()) == ["stderr", "stdout"]
        assert (out / f"rank.{r}" / "stdout").read_text() == f"out {r}\nline two {r}\nno newline {r}"
        assert (out / f"rank.{r}" / "stderr").read_text() == f"err {r}\n"
        assert f"line two {r}\n" in proc.stdout and f"err {r}\n" in proc.stderr  # the console still gets it


def test_output_filename_logs_the_sentinel_line_of_a_killed_rank(tmp_path: Path) -> None:
    """The sentinel runs inside the --output-filename wrapper: its line about a killed rank lands in that
    rank's stderr file as well as on the console."""
    out = tmp_path / "logs"
    program = "import os; print(os.getpid(), flush=True); os.environ['PMI_RANK'] == '1' and os.kill(os.getpid(), 9)"
    proc = run([*RUN, "-np", "2", "--output-filename", str(out), PYTHON, "-c", program], timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    pid = (out / "rank.1" / "stdout").read_text().strip()
    line = f"hvdlite-run: rank 1 (pid {pid} on host {os.uname().nodename}) was killed by signal 9 (SIGKILL); "
    assert (out / "rank.1" / "stderr").read_text().startswith(line), (out / "rank.1" / "stderr").read_text()
    assert line in proc.stderr, proc.stderr
    assert (out / "rank.0" / "stderr").read_text() == ""


def test_rank_labels_are_padded_as_horovodrun() -> None:
    from hvdlite.run.sentinel import padded_rank
    assert [padded_rank(r, 12) for r in (0, 3, 11)] == ["00", "03", "11"]
    assert [padded_rank(r, 10) for r in (0, 9)] == ["0", "9"]
    assert padded_rank(0, 1) == "0" and padded_rank(7, 101) == "007"


def test_prefix_output_with_timestamp(tmp_path: Path) -> None:
    out = tmp_path / "logs"
    proc = run([*RUN, "-np", "2", "--prefix-output-with-timestamp", "--output-filename", str(out), PYTHON, "-c",
                OUTPUT_PROGRAM], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stamp = r"\w{3} \w{3} \d\d \d\d:\d\d:\d\d \d{4}"
    for r in range(2):
        lines = (out / f"rank.{r}" / "stdout").read_text().split("\n")
        assert len(lines) == 3
        for line, text in zip(lines, (f"out {r}", f"line two {r}", f"no newline {r}")):
            assert re.fullmatch(stamp + rf"\[{r}\]<stdout>:{text}", line), line
        assert re.fullmatch(stamp + rf"\[{r}\]<stderr>:err {r}\n", (out / f"rank.{r}" / "stderr").read_text())
        assert re.search(stamp + rf"\[{r}\]<stdout>:line two {r}\n", proc.stdout), proc.stdout


def test_config_file(tmp_path: Path) -> None:
    """horovodrun's YAML: sections map onto the flags; a flag given on the command line wins."""
    config = tmp_path / "hvd.yaml"
    config.write_text("controller: mpi\nparams:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 2.5\n"
                      "  cache_capacity: 512\nautotune:\n  enabled: false\n  log_file: x.csv\n"
                      "timeline:\n  filename: /tmp/t.json\n  mark_cycles: true\n"
                      "stall_check:\n  enabled: false\n  warning_time_seconds: 30\n  shutdown_time_seconds: 90\n"
                      "logging:\n  level: debug\n  with_timestamp: true\nsurprise:\n  x: 1\n")
    args = parse_args(["-np", "2", "--config-file", str(config), "--cycle-time-ms", "7", "python", "t.py"])
    assert tuning_environment(args) == {
        "HVDLITE_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HVDLITE_CYCLE_TIME": "7", "HVDLITE_CACHE_CAPACITY": "512",
        "HVDLITE_TIMELINE": "/tmp/t.json", "HVDLITE_TIMELINE_MARK_CYCLES": "1", "HVDLITE_LOG_LEVEL": "DEBUG",
        "HVDLITE_LOG_HIDE_TIME": "0", "HVDLITE_STALL_CHECK_TIME_SECONDS": "30",
        "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "90", "HVDLITE_STALL_CHECK_DISABLE": "1"}
    assert args.config_notes == [f"--config-file {config}: unknown section 'surprise' is ignored"]
    config.write_text("autotune:\n  enabled: true\n  log_file: tune.csv\n  warmup_samples: 1\n"
                      "  steps_per_sample: 4\n  bayes_opt_max_samples: 6\n  gaussian_process_noise: 0.3\n")
    args = parse_args(["-np", "2", "--config-file", str(config), "--autotune-warmup-samples", "2", "python", "t.py"])
    assert tuning_environment(args) == {
        "HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG_FILE": "tune.csv", "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "2",
        "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE": "4", "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6",
        "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.3"}
    for text, message in (("autotune:\n  enabled: true\n  steps_per_sample: many\n",
                           "autotune.steps_per_sample must be a number >= 0, got 'many'"),
                          ("controller: gloo\n", "--gloo: hvdlite-run starts the ranks with MPI only"),
                          ("params:\n  cycle_time_ms: fast\n",
                           "params.cycle_time_ms must be a number >= 0, got 'fast'"),
                          ("logging:\n  level: loud\n", "logging.level must be one of TRACE, DEBUG")):
        config.write_text(text)
        proc = run([*RUN, "-np", "2", "--config-file", str(config), PYTHON, TOPOLOGY], timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_config_file_settings_reach_the_ranks(tmp_path: Path) -> None:
    config = tmp_path / "hvd.yaml"
    config.write_text("params:\n  cycle_time_ms: 3\nlogging:\n  level: trace\n")
    proc = run([*RUN, "-np", "2", "--config-file", str(config), PYTHON, TOPOLOGY, "--env",
                "HVDLITE_CYCLE_TIME,HVDLITE_LOG_LEVEL"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in topology(proc.stdout):
        assert r["env"] == {"HVDLITE_CYCLE_TIME": "3", "HVDLITE_LOG_LEVEL": "TRACE"}


def test_autotune_flags_reach_the_ranks(tmp_path: Path) -> None:
    """`hvdlite-run --autotune ...` sets horovodrun's autotune settings as HVDLITE_* variables in every rank."""
    log = tmp_path / "tune.csv"
    names = ["HVDLITE_AUTOTUNE", "HVDLITE_AUTOTUNE_LOG_FILE", "HVDLITE_AUTOTUNE_WARMUP_SAMPLES",
             "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE", "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
             "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"]
    proc = run([*RUN, "-np", "2", "--autotune", "--autotune-log-file", str(log), "--autotune-warmup-samples", "1",
                "--autotune-steps-per-sample", "5", "--autotune-bayes-opt-max-samples", "7",
                "--autotune-gaussian-process-noise", "0.25", PYTHON, TOPOLOGY, "--env", ",".join(names)],
               timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = topology(proc.stdout)
    assert len(ranks) == 2
    for r in ranks:
        assert r["env"] == dict(zip(names, ["1", str(log), "1", "5", "7", "0.25"]))
    assert log.read_text().splitlines()[0].startswith("phase,sample,fusion_threshold_bytes,cycle_time_ms")
