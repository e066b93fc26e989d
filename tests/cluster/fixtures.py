"""Session-wide real clusters for the launch tests: start once, stop at the end of the session, even on failure.

``slurm_cluster(request)`` gives a single-node Slurm cluster (tests/cluster/slurm.sh); ``netns_hosts(request)``
gives two pretend hosts h1, h2 (tests/cluster/netns.sh), with ``slurm=True`` also a Slurm cluster across them.
Where they cannot be started (not root, no packages) the test is skipped with the reason; under CI (CI set),
where they must work, it fails instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WORKERS = ROOT / "tests" / "workers"
PYTHON = sys.executable
TOPOLOGY_TAG = "HVDLITE_TOPOLOGY "


def base_env(**extra: str) -> dict[str, str]:
    """Our environment for child processes: hvdlite importable, this Python's bin first on PATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([os.path.dirname(PYTHON), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def unavailable(reason: str) -> None:
    message = f"cannot start the test cluster: {reason}"
    print(message, file=sys.stderr)
    if os.environ.get("CI"):
        pytest.fail(message + " (under CI, which runs as root, these tests must run)")
    pytest.skip(message)


def _preflight(tools: Sequence[str]) -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        unavailable("not root (Slurm daemons and network namespaces need root)")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        unavailable(f"missing {', '.join(missing)}")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        unavailable("Slurm is not installed and there is no apt-get to install it")


def _script(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------------------------------ single node
@dataclasses.dataclass
class SlurmCluster:
    """A running single-node Slurm cluster; ``env`` has SLURM_CONF for its clients."""

    conf: str
    env: dict[str, str]


_slurm: dict[str, Any] = {}


def slurm_cluster(request: pytest.FixtureRequest) -> SlurmCluster:
    if "error" in _slurm:
        unavailable(_slurm["error"])
    if "cluster" not in _slurm:
        _preflight(["bash"])
        request.config.add_cleanup(_stop_slurm)
        _slurm["started"] = True
        try:
            proc = _script([str(HERE / "slurm.sh"), "start"], timeout=600)
        except subprocess.TimeoutExpired:
            _slurm["error"] = "tests/cluster/slurm.sh start timed out"
            unavailable(_slurm["error"])
        match = re.search(r"export SLURM_CONF=(\S+)", proc.stdout)
        if proc.returncode != 0 or match is None:
            _slurm["error"] = f"tests/cluster/slurm.sh start failed ({proc.returncode}): {proc.stderr[-2000:]}"
            unavailable(_slurm["error"])
        conf = match.group(1)
        _slurm["cluster"] = SlurmCluster(conf=conf, env=base_env(SLURM_CONF=conf))
    return _slurm["cluster"]


def _stop_slurm() -> None:
    if _slurm.pop("started", False):
        _script([str(HERE / "slurm.sh"), "stop"], timeout=120)
    _slurm.clear()


# ---------------------------------------------------------------------------------------- pretend hosts
@dataclasses.dataclass
class NetnsHosts:
    """Pretend hosts h1, h2...: run commands on them with ``on(host, cmd)``."""

    directory: Path
    prefix: str
    hosts: list[str]
    slurm_conf: Optional[str] = None

    @property
    def nsrsh(self) -> str:
        return str(self.directory / "nsrsh")

    def on(self, host: str, command: str, timeout: float = 180, slurm: bool = False,
           env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
        """Run a shell command on ``host`` with the MPI settings for these hosts (and SLURM_CONF)."""
        prefix = f". {shlex.quote(str(self.directory / 'mpi.env'))}; cd {shlex.quote(str(ROOT))}; "
        if slurm:
            prefix += f"export SLURM_CONF={shlex.quote(str(self.slurm_conf))}; "
        return run([self.nsrsh, host, prefix + command], timeout=timeout, env=env or base_env())

    def link_bytes(self, host: str) -> dict[str, int]:
        """rx/tx byte counters of ``host``'s hvd0, read from outside."""
        out = subprocess.run(["ip", "-n", f"{self.prefix}-{host}", "-j", "-s", "link", "show", "hvd0"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"rx": int(stats["rx"]["bytes"]), "tx": int(stats["tx"]["bytes"])}


_netns: dict[str, Any] = {}


def netns_hosts(request: pytest.FixtureRequest, slurm: bool = False, count: int = 2) -> NetnsHosts:
    """Pretend hosts h1..hN (N = ``count``, at least 2); asking for more hosts than are up recreates them
    (and stops their Slurm cluster, which the next ``slurm=True`` call starts again)."""
    if "error" in _netns:
        unavailable(_netns["error"])
    if "hosts" in _netns and len(_netns["hosts"].hosts) < count:
        _script([str(HERE / "netns.sh"), "down"], timeout=180)
        del _netns["hosts"]
    if "hosts" not in _netns:
        _preflight(["bash", "ip", "nsenter", "unshare"])
        if not _netns.get("started"):
            request.config.add_cleanup(_netns_down)
        _netns["started"] = True
        proc = _script([str(HERE / "netns.sh"), "up", str(max(2, count))], timeout=120)
        if proc.returncode != 0:
            _netns["error"] = f"tests/cluster/netns.sh up failed ({proc.returncode}): {proc.stderr[-2000:]}"
            unavailable(_netns["error"])
        directory = Path(os.environ.get("HVDT_NETNS_DIR") or Path(os.environ.get("TMPDIR") or "/tmp",
                                                                      "hvdlite-netns"))
        _netns["hosts"] = NetnsHosts(directory=directory, prefix=os.environ.get("HVDT_NETNS_PREFIX", "hvdt"),
                                     hosts=[f"h{k}" for k in range(1, max(2, count) + 1)])
    hosts: NetnsHosts = _netns["hosts"]
    if slurm and hosts.slurm_conf is None:
        try:
            proc = _script([str(HERE / "netns.sh"), "slurm-up"], timeout=600)
        except subprocess.TimeoutExpired:
            unavailable("tests/cluster/netns.sh slurm-up timed out")
        if proc.returncode != 0:
            unavailable(f"tests/cluster/netns.sh slurm-up failed ({proc.returncode}): {proc.stderr[-2000:]}")
        hosts.slurm_conf = str(hosts.directory / "slurm" / "etc" / "slurm.conf")
    return hosts


def _netns_down() -> None:
    if _netns.pop("started", False):
        _script([str(HERE / "netns.sh"), "down"], timeout=180)
    _netns.clear()


# ---------------------------------------------------------------------------------------------- helpers
def run(cmd: Sequence[str], timeout: float = 180, env: Optional[dict[str, str]] = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; a timeout fails the test with what it printed so far."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env or base_env(),
                              cwd=cwd, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{shlex.join(cmd)} timed out after {timeout} s\nstdout:\n{out}\nstderr:\n{err}")


def topology(output: str) -> list[dict[str, Any]]:
    """The per-rank report the topology worker prints on rank 0."""
    lines = [line for line in output.splitlines() if line.startswith(TOPOLOGY_TAG)]
    assert len(lines) == 1, f"expected one {TOPOLOGY_TAG.strip()} line, got {len(lines)}:\n{output}"
    return json.loads(lines[0][len(TOPOLOGY_TAG):])


def assert_topology(ranks: list[dict[str, Any]], hosts: int, per_host: int) -> None:
    """Ranks fill hosts in order: rank r is local rank r % per_host on host r // per_host."""
    size = hosts * per_host
    assert [r["rank"] for r in ranks] == list(range(size))
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        assert r["size"] == size and r["allreduce_ok"], r
        assert (r["local_rank"], r["local_size"]) == (r["rank"] % per_host, per_host), r
        assert (r["cross_rank"], r["cross_size"]) == (r["rank"] // per_host, hosts), r
        by_host.setdefault(r["host"], []).append(r["rank"])
    assert len(by_host) == hosts, by_host
    assert sorted(by_host.values()) == [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_gone(pids: Sequence[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for the processes to end; return those still alive."""
    deadline = time.monotonic() + seconds
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive


@dataclasses.dataclass
class JobResult:
    job_id: str
    state: str
    exit_code: int
    output: str


def sbatch_wait(args: Sequence[str], output: Path, timeout: float, env: dict[str, str],
                via: Optional[Sequence[str]] = None) -> JobResult:
    """Submit a batch job, poll until it has left the queue (every 0.25 s), return its state and output.

    ``via`` runs each Slurm command elsewhere: its last item is a shell prefix for the command (e.g.
    ``[nsrsh, "h1", ". mpi.env; export SLURM_CONF=...; "]`` for the pretend-host cluster).
    """
    def slurm(command: str, limit: float = 60) -> subprocess.CompletedProcess:
        cmd = [*via[:-1], via[-1] + command] if via else ["bash", "-c", command]
        return run(cmd, timeout=limit, env=env)

    submit = slurm(f"sbatch --parsable --chdir={shlex.quote(str(ROOT))} -o {shlex.quote(str(output))} "
                   + shlex.join(list(args)))
    assert submit.returncode == 0, f"sbatch failed: {submit.stdout}\n{submit.stderr}"
    job_id = submit.stdout.strip().split(";")[0].splitlines()[-1]
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    while True:
        # squeue itself can fail under load (slurmctld busy: "Socket timed out"): that says nothing about
        # the job, so ask again; only a listing without the job, or "Invalid job id" (the controller
        # already forgot it), means it left the queue
        queued = slurm(f"squeue -h -j {job_id}")
        if queued.returncode == 0 and job_id not in queued.stdout:
            break
        if queued.returncode != 0:
            if "Invalid job id" in queued.stderr:
                break
            failures.append(queued.stderr.strip())
        if time.monotonic() > deadline:
            slurm(f"scancel {job_id}")
            text = output.read_text() if output.exists() else ""
            pytest.fail(f"job {job_id} ran past {timeout} s; cancelled ({len(failures)} squeue calls failed, the "
                        f"last: {failures[-1:]}). Output so far:\n{text}")
        time.sleep(0.25)
    for _ in range(240):  # scontrol can fail under load the same way: retry for up to a minute
        shown = slurm(f"scontrol show job {job_id}")
        if shown.returncode == 0 or "Invalid job id" in shown.stderr:
            break
        time.sleep(0.25)
    info = shown.stdout
    state = re.search(r"JobState=(\w+)", info)
    code = re.search(r"\sExitCode=(\d+):(\d+)", info)
    text = output.read_text() if output.exists() else ""
    return JobResult(job_id=job_id, state=state.group(1) if state else "UNKNOWN",
                     exit_code=int(code.group(1)) if code else -1, output=text)


def _start_sleepers(cmd: Sequence[str], env: dict[str, str], pid_dir: Path,
                    python: str) -> tuple[subprocess.Popen, list[int]]:
    """Start a launcher running tests/workers/launch_sleep.py (each rank writes ``pid_dir/<rank>.pid``) and
    wait until two ranks run; return the launcher and the ranks' pids."""
    proc = subprocess.Popen([*cmd, python, str(WORKERS / "launch_sleep.py"), str(pid_dir)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.glob("*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start within 120 s"
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, [int(p.read_text()) for p in pid_dir.glob("*.pid")]


def assert_ctrl_c_stops_every_rank(cmd: Sequence[str], env: dict[str, str], pid_dir: Path,
                                   sig: int = signal.SIGINT, python: str = PYTHON) -> str:
    """Start a launcher running tests/workers/launch_sleep.py, send it ``sig`` (SIGINT: a terminal's
    Ctrl-C) once two ranks run, and check it exits with 128+sig (130, 143) with every rank gone; return the
    launcher's output."""
    proc, pids = _start_sleepers(cmd, env, pid_dir, python)
    try:
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, (proc.returncode, out + err)
    alive = wait_gone(pids, 30)
    assert not alive, f"ranks {alive} still run after {signal.Signals(sig).name}"
    return out + err


def tagged_processes(tag: str) -> dict[int, str]:
    """Live processes whose environment holds HVDT_JOB_TAG=``tag`` (a job's launcher, daemons, wrappers and
    ranks all inherit it), by pid, with their command lines."""
    found = {}
    needle = f"HVDT_JOB_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and pid_alive(int(entry.name)):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def assert_kill_9_takes_the_job(cmd: Sequence[str], env: dict[str, str], pid_dir: Path,
                                python: str = PYTHON) -> None:
    """SIGKILL of the launcher command ``cmd`` (what subprocess.run(..., timeout=...) does on its timeout)
    while two ranks of tests/workers/launch_sleep.py run: within 20 s no process of the job is left (the
    launcher's children, its per-host daemons, the rank wrappers and the ranks)."""
    tag = os.urandom(8).hex()
    proc, pids = _start_sleepers(cmd, {**env, "HVDT_JOB_TAG": tag}, pid_dir, python)
    job = tagged_processes(tag)
    assert set(pids) <= set(job) and proc.pid in job, (pids, job)
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 20
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged_processes(tag)
    for pid in left:  # do not leave them to the rest of the suite
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"20 s after kill -9 of {cmd[0]} these processes of its job still run: {left}"
