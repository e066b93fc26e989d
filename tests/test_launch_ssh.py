"""hvdlite-run's -p/--ssh-port and -i/--ssh-identity-file against real sshd servers: one sshd per pretend host
(network namespaces h1, h2 of tests/cluster/netns.sh) on a non-default port, public-key login only, with a key
that is not in ~/.ssh. Needs root and Debian's openssh-server (installed with apt-get when /usr/sbin/sshd is
missing)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

from cluster.fixtures import PYTHON, WORKERS, NetnsHosts, assert_topology, netns_hosts, topology, unavailable

TOPOLOGY = str(WORKERS / "launch_topology.py")
PORT = 2299  # not 22: a launch that forgets -p finds nothing there
SSHD = "/usr/sbin/sshd"


class SshHosts(NamedTuple):
    hosts: NetnsHosts
    key: Path  # the private key whose public half every sshd accepts
    bin: Path  # holds `ssh`: the real client with a config that trusts the throw-away host keys


#: As tests/cluster/slurm.sh installs Slurm: the package's scripts must not start a system sshd on port 22.
INSTALL = """set -e
export DEBIAN_FRONTEND=noninteractive
added=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\\nexit 101\\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; added=1
fi
rc=0
{ apt-get update -qq && apt-get install -y -qq --no-install-recommends openssh-server >/dev/null; } || rc=$?
[ $added = 1 ] && rm -f /usr/sbin/policy-rc.d
exit $rc
"""


def install_sshd() -> None:
    """Debian's openssh-server, if /usr/sbin/sshd is missing (no system sshd is started)."""
    if os.path.exists(SSHD):
        return
    if shutil.which("apt-get") is None:
        unavailable("sshd is not installed (Debian package openssh-server) and there is no apt-get to install it")
    proc = subprocess.run(["bash", "-c", INSTALL], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not os.path.exists(SSHD):
        unavailable(f"apt-get install openssh-server failed ({proc.returncode}): {proc.stderr[-1500:]}")


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvdlite-test", "-f", str(path)],
                   check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def ssh_hosts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    hosts = netns_hosts(request)
    install_sshd()
    work = tmp_path_factory.mktemp("sshd")
    keygen(work / "host_key")
    keygen(work / "user_key")
    (work / "authorized_keys").write_text((work / "user_key.pub").read_text())
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    pidfiles = []
    for host in hosts.hosts[:2]:
        config = work / f"sshd_{host}.conf"
        pidfiles.append(work / f"sshd_{host}.pid")
        config.write_text(f"Port {PORT}\nHostKey {work / 'host_key'}\nPidFile {pidfiles[-1]}\n"
                          f"AuthorizedKeysFile {work / 'authorized_keys'}\nPubkeyAuthentication yes\n"
                          "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                          "PermitRootLogin prohibit-password\nStrictModes no\nLogLevel VERBOSE\n")
        proc = hosts.on(host, f"{SSHD} -f {config} -E {work / f'sshd_{host}.log'}", timeout=60)
        if proc.returncode != 0:
            unavailable(f"sshd would not start on {host}: {proc.stdout}{proc.stderr}")
    request.addfinalizer(lambda: [os.kill(int(p.read_text()), signal.SIGTERM) for p in pidfiles if p.exists()])
    bindir = work / "bin"
    bindir.mkdir()
    (work / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                     "  BatchMode yes\n  IdentitiesOnly yes\n  LogLevel ERROR\n")
    (bindir / "ssh").write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {work / 'ssh_config'} \"$@\"\n")
    (bindir / "ssh").chmod(0o755)
    yield SshHosts(hosts, work / "user_key", bindir)


def logins(ssh: SshHosts) -> int:
    """How many key logins h2's sshd has accepted so far."""
    return (ssh.key.parent / "sshd_h2.log").read_text().count("Accepted publickey for root")


def launch(ssh: SshHosts, flags: str) -> subprocess.CompletedProcess:
    return ssh.hosts.on("h1", f"PATH={ssh.bin}:$PATH {PYTHON} -m hvdlite.run --verbose -H h1:1,h2:1 -np 2 "
                              f"--start-timeout 10 {flags} {PYTHON} {TOPOLOGY} --iface hvd0", timeout=120)


def test_ssh_port_and_identity_file_reach_real_sshd(ssh_hosts: SshHosts) -> None:
    """`hvdlite-run -H h1:1,h2:1 -p PORT -i KEY`: hydra's ssh uses both, and each rank runs on its host."""
    before = logins(ssh_hosts)
    proc = launch(ssh_hosts, f"-p {PORT} -i {ssh_hosts.key}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"HYDRA_LAUNCHER_EXTRA_ARGS='-p {PORT} -i {ssh_hosts.key} -o ConnectTimeout=10'" in proc.stdout
    ranks = topology(proc.stdout)
    assert_topology(ranks, hosts=2, per_host=1)
    assert [r["host"] for r in ranks] == ["h1", "h2"]
    assert logins(ssh_hosts) > before  # h2's rank came through its sshd


@pytest.mark.parametrize("missing", ["port", "identity"])
def test_without_the_ssh_flag_the_remote_host_is_unreachable(ssh_hosts: SshHosts, missing: str) -> None:
    """The same launch without -p (nothing listens on 22) or without -i (no other key is accepted) fails:
    the flags, not some default, are what reached the hosts."""
    flags = f"-i {ssh_hosts.key}" if missing == "port" else f"-p {PORT}"
    proc = launch(ssh_hosts, flags)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "HVDLITE_TOPOLOGY" not in proc.stdout
    reason = "Connection refused" if missing == "port" else "Permission denied (publickey)"
    assert reason in proc.stderr, proc.stderr


def test_open_mpi_ssh_port_and_identity_file(ssh_hosts: SshHosts, ompi_python: str) -> None:  # noqa: F811
    """The same with Open MPI's mpirun (plm_rsh_args): prterun's daemon on h2 is started over that sshd."""
    before = logins(ssh_hosts)
    proc = ssh_hosts.hosts.on("h1", f"PATH={ssh_hosts.bin}:$PATH {ompi_python} -m hvdlite.run --verbose "
                                    f"-H h1:1,h2:1 -np 2 --network-interface hvd0 -p {PORT} -i {ssh_hosts.key} "
                                    f"{ompi_python} {TOPOLOGY} --iface hvd0", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"--mca plm_rsh_args '-p {PORT} -i {ssh_hosts.key}'" in proc.stdout, proc.stdout
    ranks = topology(proc.stdout)
    assert [r["host"] for r in ranks] == ["h1", "h2"]
    assert logins(ssh_hosts) > before
