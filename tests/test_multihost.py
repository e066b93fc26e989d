"""Two pretend hosts (network namespaces h1, h2 with their own hostnames and addresses), 2 ranks each."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from cluster.fixtures import (PYTHON, ROOT, WORKERS, NetnsHosts, assert_topology, base_env, netns_hosts,
                              sbatch_wait, topology)

TOPOLOGY = str(WORKERS / "launch_topology.py")
BIG = 8 * 1024 * 1024  # bytes of the allreduce that must cross the link


@pytest.fixture(scope="session")
def hosts(request: pytest.FixtureRequest) -> NetnsHosts:
    return netns_hosts(request)


@pytest.fixture(scope="session")
def slurm_hosts(request: pytest.FixtureRequest) -> NetnsHosts:
    return netns_hosts(request, slurm=True)


def test_mpiexec_two_hosts_topology_and_traffic(hosts: NetnsHosts) -> None:
    """mpiexec -hosts h1:2,h2:2: local/cross ranks are right and the allreduce's bytes crossed the link."""
    before = hosts.link_bytes("h2")
    proc = hosts.on("h1", f"{shlex.quote(str(Path(PYTHON).parent / 'mpiexec'))} -launcher ssh -launcher-exec "
                          f"{hosts.nsrsh} -hosts h1:2,h2:2 -n 4 {PYTHON} {TOPOLOGY} --bytes {BIG} --iface hvd0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = hosts.link_bytes("h2")
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=2, per_host=2)
    assert [r["host"] for r in ranks] == ["h1", "h1", "h2", "h2"]
    for r in ranks:
        assert r["big_ok"], r
        # every byte of an allreduce between two hosts must be received by each host at least once
        assert r["link"]["rx"] >= BIG and r["link"]["tx"] >= BIG, r
    assert after["rx"] - before["rx"] >= BIG and after["tx"] - before["tx"] >= BIG, (before, after)


def test_hvdlite_run_two_hosts(hosts: NetnsHosts) -> None:
    """`hvdlite-run -np 4 -H h1:2,h2:2` from h1; hydra reaches h2 through the ssh stand-in (--mpi-args)."""
    mpi_args = shlex.quote(f"-launcher ssh -launcher-exec {hosts.nsrsh}")
    proc = hosts.on("h1", f"{PYTHON} -m hvdlite.run --verbose -np 4 -H h1:2,h2:2 --network-interface hvd0 "
                          f"-x HVDT_FROM=h1 --mpi-args={mpi_args} {PYTHON} {TOPOLOGY} --env HVDT_FROM")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-hosts h1:2,h2:2 -iface hvd0" in proc.stdout, proc.stdout
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=2, per_host=2)
    assert [r["host"] for r in ranks] == ["h1", "h1", "h2", "h2"]
    assert all(r["env"] == {"HVDT_FROM": "h1"} for r in ranks), ranks


def test_hvdlite_run_refuses_more_ranks_than_slots(hosts: NetnsHosts) -> None:
    proc = hosts.on("h1", f"{PYTHON} -m hvdlite.run -np 5 -H h1:2,h2:2 {PYTHON} {TOPOLOGY}")
    assert proc.returncode == 2
    assert "asked for 5 processes (-np 5) but the hosts give only 4 slots (h1:2,h2:2)" in proc.stderr


def test_multi_node_sbatch(slurm_hosts: NetnsHosts, tmp_path: Path) -> None:
    """sbatch of slurm/multi_node_gpu.sbatch on a 2-node Slurm cluster (2 tasks and 2 pretend GPUs a node)."""
    via = [slurm_hosts.nsrsh, "h1"]
    env_setup = (f". {slurm_hosts.directory / 'mpi.env'}; export SLURM_CONF={slurm_hosts.slurm_conf}; "
                 f"cd {ROOT}; ")
    job = sbatch_wait(["--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                       str(ROOT / "slurm" / "multi_node_gpu.sbatch"), PYTHON, TOPOLOGY],
                      tmp_path / "job.out", timeout=120, env=base_env(), via=[*via, env_setup])
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    assert "2 nodes (h[1-2]), 4 ranks" in job.output, job.output
    ranks = topology(job.output)
    assert_topology(ranks, hosts=2, per_host=2)
    assert [r["host"] for r in ranks] == ["h1", "h1", "h2", "h2"]
    assert [r["slurm_procid"] for r in ranks] == ["0", "1", "2", "3"]

