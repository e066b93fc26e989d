"""hvdlite-run on this machine: flags, command building for each launcher, real runs, errors, Ctrl-C."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import make_child_venv
from cluster.fixtures import (PYTHON, WORKERS, assert_ctrl_c_stops_every_rank, assert_topology, base_env,
                              run, topology)
from hvdlite.run.args import TUNING_FLAGS, env_assignments, parse_args, tuning_environment
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
    assert {setting for setting, _ in TUNING_FLAGS.values()} <= set(Config.field_names())


def test_command_for_each_launcher() -> None:
    plan = Plan(num_proc=4, command=["python", "t.py"], hosts=parse_hosts("h1:2,h2:2"),
                extra_env={"FOO": "1"}, mpi_args=["-v"], network_interface="eth1", is_root=True)
    mpich = Launcher(MPICH, "/bin/mpiexec", "HYDRA 5")
    assert build_command(mpich, plan, {}) == [
        "/bin/mpiexec", "-n", "4", "-hosts", "h1:2,h2:2", "-iface", "eth1", "-genv", "FOO", "1", "-v",
        "python", "t.py"]
    ompi = Launcher(OPENMPI, "/bin/mpirun", "Open MPI 5")
    env = child_environment({"PATH": "/bin", "HVDLITE_CYCLE_TIME": "2", "OTHER": "x"}, plan, ompi)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert build_command(ompi, plan, env) == [
        "/bin/mpirun", "--allow-run-as-root", "-np", "4", "-H", "h1:2,h2:2", "--bind-to", "none",
        "--map-by", "slot", "--mca", "btl_tcp_if_include", "eth1", "--mca", "oob_tcp_if_include", "eth1",
        "-x", "FOO", "-x", "HVDLITE_CYCLE_TIME", "-x", "HVDLITE_LAUNCHED_BY", "-x", "PATH", "-v",
        "python", "t.py"]
    local = Plan(num_proc=3, command=["p"], is_root=False)
    assert build_command(ompi, local, {})[:4] == ["/bin/mpirun", "-np", "3", "-H"]
    assert "localhost:3" in build_command(ompi, local, {})
    srun = Launcher(SRUN, "/usr/bin/srun", "slurm 22.05")
    assert build_command(srun, Plan(num_proc=2, command=["p"], srun_mpi="pmix", in_slurm=True), {}) == [
        "/usr/bin/srun", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1", "--export=ALL", "p"]
    mpich_lib = MPILibrary(library_family("MPICH Version: 5.0.2"), "MPICH 5.0.2")
    ompi_lib = MPILibrary(library_family("Open MPI v5.0.11, package: Open MPI"), "Open MPI 5.0.11")
    assert choose_srun_mpi(mpich_lib, ["pmix", "none", "pmi2"]) == "pmi2"
    assert choose_srun_mpi(ompi_lib, ["pmix", "none", "pmi2"]) == "pmix"
    with pytest.raises(RuntimeError, match="no PMI plugin"):
        choose_srun_mpi(ompi_lib, ["none"])


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


def test_no_launcher_found(tmp_path: Path) -> None:
    """With no mpiexec/mpirun next to Python or on PATH, hvdlite-run says so and how to fix it."""
    python = make_child_venv(tmp_path / "venv")
    env = base_env(PATH="/usr/bin:/bin")
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
    assert "[X] MPICH hydra mpiexec" in out or "[X] Open MPI" in out, out


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    """SIGINT to hvdlite-run (a terminal's Ctrl-C) stops every rank and exits non-zero."""
    assert_ctrl_c_stops_every_rank([*RUN, "-np", "2"], base_env(), tmp_path)
