"""hvdlite-run's per-rank sentinel on its own (no MPI): exit codes, the line naming the rank, signal
forwarding, the program dying with it, --exec with the output files, and what it imports."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.fixtures import pid_alive, wait_gone
from conftest import ROOT
from hvdlite.run.commands import SENTINEL

HOST = os.uname().nodename


def sentinel(program: list, env: dict, flags: tuple = (), **kwargs: object) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                                                 "SLURM_PROCID")}
    return subprocess.Popen([sys.executable, "-S", SENTINEL, *flags, "--", *program], env={**full, **env}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


@pytest.mark.parametrize("variable", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"])
def test_a_program_killed_by_a_signal_is_named_with_its_rank(variable: str) -> None:
    proc = sentinel([sys.executable, "-c", "import os; print(os.getpid(), flush=True); os.kill(os.getpid(), 9)"],
                    {variable: "3"})
    code, out, err = finish(proc)
    assert code == 128 + 9, err
    assert err == (f"hvdlite-run: rank 3 (pid {out.strip()} on host {HOST}) was killed by signal 9 (SIGKILL); the "
                   f"launcher stops the other ranks because of it (a SIGKILL nobody sent by hand is often the "
                   f"kernel's out-of-memory killer: see dmesg on that host)\n")


def test_exit_codes_pass_through() -> None:
    code, out, err = finish(sentinel([sys.executable, "-c", "import sys; print('hi'); sys.exit(0)"], {}))
    assert (code, out, err) == (0, "hi\n", "")
    proc = sentinel([sys.executable, "-c", "import os, sys; print(os.getpid()); sys.exit(5)"], {"PMI_RANK": "1"})
    code, out, err = finish(proc)
    assert (code, err) == (5, f"hvdlite-run: rank 1 (pid {out.strip()} on host {HOST}) exited with code 5\n")
    code, _, err = finish(sentinel(["/no/such/program"], {"PMI_RANK": "0"}))
    assert code == 127 and err.startswith("hvdlite-run: rank 0: cannot start /no/such/program: No such file"), err


def test_stop_signals_reach_the_program_and_are_not_reported(tmp_path: Path) -> None:
    """SIGUSR1 (e.g. srun --signal) reaches the program's handler; SIGTERM ends it (143) with no line."""
    ready = tmp_path / "ready"
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGUSR1, lambda *a: print('USR1', flush=True))\n"
              f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
              "time.sleep(60)\n")
    proc = sentinel([sys.executable, "-c", script], {"PMI_RANK": "0"})
    deadline = time.monotonic() + 30
    while not ready.exists() or not ready.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert (code, out, err) == (128 + signal.SIGTERM, "USR1\n", "")


def test_the_program_dies_with_the_sentinel(tmp_path: Path) -> None:
    """kill -9 of the sentinel (as hydra stops the other ranks) takes its program down (PR_SET_PDEATHSIG)."""
    ready = tmp_path / "pid"
    script = f"import os, time; open({str(ready)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = sentinel([sys.executable, "-c", script], {}, start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists() or not ready.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    child = int(ready.read_text())
    assert pid_alive(child)
    proc.kill()
    finish(proc)
    assert wait_gone([child], 10) == [], f"the program (pid {child}) outlived its sentinel"


def test_the_program_stops_when_the_sentinels_parent_dies(tmp_path: Path) -> None:
    """kill -9 of the process that started the sentinel (a launcher's per-host daemon, left without its
    launcher) stops the sentinel and its program: the sentinel gets SIGTERM (PR_SET_PDEATHSIG) and forwards
    it, so the program ends as on any stop, and the sentinel reports no killed rank."""
    ready = tmp_path / "pid"
    program = f"import os, time; open({str(ready)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    daemon = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-S', {SENTINEL!r}, '--', "
              f"sys.executable, '-c', {program!r}]); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", daemon], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists() or not ready.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    child = int(ready.read_text())
    watcher = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the sentinel
    assert pid_alive(child) and pid_alive(watcher)
    proc.kill()
    proc.wait()
    assert wait_gone([child, watcher], 10) == [], "the sentinel or its program outlived the daemon that started it"


def test_exec_becomes_the_program_and_still_writes_the_output_files(tmp_path: Path) -> None:
    """--exec (--no-launch-sentinel) with --dir and --timestamp: the program is this process (same pid), its
    exit code is the process's with no line, and every line, the last one without newline too, is stamped on
    the console and in DIR/rank.<rank>/."""
    program = "import os, sys; print(os.getpid()); print('err', file=sys.stderr); sys.stdout.write('end'); sys.exit(5)"
    proc = sentinel([sys.executable, "-c", program], {"PMI_RANK": "2", "PMI_SIZE": "12"},
                    ("--exec", "--dir", str(tmp_path), "--timestamp"))
    code, out, err = finish(proc)
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[2\]"
    assert code == 5 and re.fullmatch(rf"{stamp}<stdout>:{proc.pid}\n{stamp}<stdout>:end", out), out
    assert re.fullmatch(rf"{stamp}<stderr>:err\n", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.02"]
    assert (tmp_path / "rank.02" / "stdout").read_text() == out and (tmp_path / "rank.02" / "stderr").read_text() == err


def test_the_sentinel_imports_neither_hvdlite_nor_numpy() -> None:
    """It lives as long as its rank: the standard library only (plus hvdlite.core.launch_check when it
    reports, loaded without the packages' __init__)."""
    proc = subprocess.run([sys.executable, "-S", "-X", "importtime", SENTINEL, "--", sys.executable, "-c",
                           "import os; os.kill(os.getpid(), 15)"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PMI_RANK": "0"}, cwd=ROOT)
    assert proc.returncode == 128 + 15, proc.stderr
    assert "hvdlite-run: rank 0 (pid" in proc.stderr, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "import time:" in line}
    assert "hvdlite.core.config" in imported, sorted(imported)  # for the rank (launch_check)
    heavy = sorted(m for m in imported if m.split(".")[0] in ("numpy", "mpi4py", "torch", "tensorflow")
                   or m in ("hvdlite.core.api", "hvdlite.core.engine", "hvdlite.run.commands"))
    assert heavy == [], heavy
