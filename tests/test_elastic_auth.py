"""The elastic driver's endpoint, in one process: it listens on loopback for a job on this machine, and only
messages signed with the job's secret count; a rank's link signs with the secret from its environment."""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading

import pytest

from cluster.elastic import wait_until
from hvdlite.core.elastic.link import DriverLink
from hvdlite.core.elastic_wire import (DRIVER_VARIABLE, GENERATION_VARIABLE, RESTART_VARIABLE, SECRET_VARIABLE,
                                       STANDBY_VARIABLE, signature)
from hvdlite.run.elastic.server import DriverServer, bind_address


@pytest.fixture
def server():
    logged: list[str] = []
    srv = DriverServer(logged.append, secrets.token_hex(32))
    srv.new_attempt(0)
    srv.logged = logged  # type: ignore[attr-defined]
    yield srv
    srv.close()


def raw_client(srv: DriverServer) -> tuple[socket.socket, str]:
    """A plain TCP client of the endpoint and the nonce the driver greeted it with."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    nonce = json.loads(sock.makefile("r").readline())["nonce"]
    return sock, nonce


def hello(rank: int, seq: int = 1) -> dict:
    return {"op": "hello", "rank": rank, "size": 2, "host": "h", "pid": 10 + rank, "attempt": 0, "seq": seq}


def test_only_messages_signed_with_the_job_secret_count(server: DriverServer,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    secret = server._secret
    assert server.address == "127.0.0.1" and bind_address(["localhost"], ["eth-none"]) == "127.0.0.1"
    # no signature, a wrong secret, a replay of a genuine message on another connection, a non-ASCII
    # signature, an endless line: refused, and the endpoint keeps serving
    cases = []
    sock, _ = raw_client(server)
    cases.append((sock, hello(7)))
    sock, nonce = raw_client(server)
    cases.append((sock, dict(hello(8), mac=signature("not-the-secret", nonce, hello(8)))))
    sock, nonce = raw_client(server)
    genuine = dict(hello(9), mac=signature(secret, nonce, hello(9)))
    sock2, _ = raw_client(server)
    cases.append((sock2, genuine))
    sock, _ = raw_client(server)
    cases.append((sock, dict(hello(6), mac="\u00e9" * 64)))  # not ASCII: compare_digest would raise on str
    sock, _ = raw_client(server)
    cases.append((sock, {"junk": "x" * (1 << 17)}))  # far longer than any rank's message
    for sock, message in cases:
        try:
            sock.sendall((json.dumps(message) + "\n").encode())
            closed = sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):  # closed while the long line was being sent
            closed = True
        assert closed, f"the driver closes a refused connection: {str(message)[:80]}"
    refusals = [m for m in server.logged if m.startswith("refused a connection from 127.0.0.1:")]
    assert len(refusals) == 5 and "not signed with this job's secret" in refusals[0], server.logged
    assert all(secret not in line for line in server.logged)
    assert server.snapshot() == []  # nothing registered, nothing lost
    # a rank with the secret (as the driver starts it): registered, its report counts
    monkeypatch.setenv(DRIVER_VARIABLE, f"127.0.0.1:{server.port}")
    monkeypatch.setenv(SECRET_VARIABLE, secret)
    link = DriverLink()
    link.connect(rank=1, size=2)
    assert link.current_generation() == 0
    server.bump_generation()
    assert link.current_generation() == 1
    link.send(op="done")
    wait_until(lambda: [(r.rank, r.ended) for r in server.snapshot()] == [(1, "done")], "rank 1 done")
    link.close()


def test_a_rank_without_the_secret_is_told_why(monkeypatch: pytest.MonkeyPatch, server: DriverServer) -> None:
    monkeypatch.setenv(DRIVER_VARIABLE, f"127.0.0.1:{server.port}")
    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    with pytest.raises(ConnectionError, match=f"{SECRET_VARIABLE} is not: only the processes hvdlite-run's "
                                              f"elastic driver starts may talk to it"):
        DriverLink().connect(rank=0, size=1)


def test_the_stall_verdict_asks_the_driver_to_end_silent_ranks_of_other_hosts_only(
        server: DriverServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A survivor's stall inspector can kill only its own host's silent ranks (core/fencing.py); for those of
    other hosts it sends the driver their host, pid and start time, which the driver then ends as it ends ranks
    the survivors declared lost (inprocess.Losses.to_fence: only while their connection is still open)."""
    from hvdlite.core.fencing import Peer, fence_elsewhere, this_process
    from hvdlite.run.elastic.inprocess import Losses

    monkeypatch.setenv(DRIVER_VARIABLE, f"127.0.0.1:{server.port}")
    monkeypatch.setenv(SECRET_VARIABLE, server._secret)
    here = this_process()
    peers = [here, Peer(here.host, 4242, 99), Peer("h-elsewhere", 77, 1234), Peer("h-other", 78, 0)]
    links = []
    for rank in (2, 0):  # rank 0's link, connected last, is the one fence_elsewhere uses
        link = DriverLink()
        link.connect(rank=rank, size=4)
        links.append(link)
    fence_elsewhere([0, 1, 3], peers, "answered no probes")  # this host's, or no start time: nothing sent
    fence_elsewhere([1, 2], peers, "answered no probes for 4 s")
    wait_until(lambda: any(r.declared_lost for r in server.snapshot()), "the driver told")
    survivor = next(r for r in server.snapshot() if r.rank == 0)
    assert survivor.declared_lost == (("h-elsewhere", 77, 1234),) and survivor.recovered == ()
    assert any("rank(s) [2] (host(s) h-elsewhere) answered no probes for 4 s: asked hvdlite-run's elastic driver "
               "to end them on their hosts" in r.getMessage() for r in caplog.records), caplog.text
    ranks = server.snapshot()
    silent = next(r for r in ranks if r.rank == 2)
    silent.host, silent.pid = "h-elsewhere", 77  # (its hello came from this machine)
    assert [(info.rank, started) for info, started, _ in Losses(4).to_fence(ranks, 0.0)] == [(2, 1234)]
    for link in links:
        link.close()
    fence_elsewhere([2], peers, "answered no probes")  # no driver link left: nothing to ask, nothing raised


def test_a_standby_jobs_ranks_wait_for_the_handover_then_join_as_the_new_jobs(
        server: DriverServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby job's rank (HVDLITE_ELASTIC_STANDBY) waits in connect, counted but not joined, until the driver
    hands the run over (release): it then joins as a rank of that job, with its restart count and generation; a
    waiting rank whose connection closes is no longer counted."""
    monkeypatch.setenv(DRIVER_VARIABLE, f"127.0.0.1:{server.port}")
    monkeypatch.setenv(SECRET_VARIABLE, server._secret)
    for name, value in ((STANDBY_VARIABLE, "1"), (RESTART_VARIABLE, "1"), (GENERATION_VARIABLE, "0")):
        monkeypatch.setenv(name, value)
    links: list[DriverLink] = []

    def connect() -> None:
        link = DriverLink()
        link.connect(rank=0, size=2)
        links.append(link)

    waiting = threading.Thread(target=connect, daemon=True)
    waiting.start()
    sock, nonce = raw_client(server)  # another standby rank, which dies while it waits
    message = {"op": "standby", "rank": 1, "size": 2, "seq": 1}
    sock.sendall((json.dumps(dict(message, mac=signature(server._secret, nonce, message))) + "\n").encode())
    wait_until(lambda: server.standing_by() == 2, "both standby ranks wait")
    sock.close()
    wait_until(lambda: server.standing_by() == 1, "the closed one no longer counted")
    waiting.join(0.5)
    assert waiting.is_alive() and server.snapshot() == [] and not links  # waiting, not joined
    server.new_attempt(3)
    server.bump_generation()
    server.release(3)
    waiting.join(10)
    assert [(link.generation, link.restart) for link in links] == [(1, 3)] and server.standing_by() == 0
    assert os.environ[RESTART_VARIABLE] == "1" and os.environ[GENERATION_VARIABLE] == "0"  # (the link holds them)
    wait_until(lambda: [(r.rank, r.attempt) for r in server.snapshot()] == [(0, 3)], "joined as reset 3's rank 0")
    links[0].close()


def test_a_fault_tolerant_rank_kills_only_the_stopped_ranks_of_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """While its engine waits, a rank of a fault-tolerant job kills the stopped processes (SIGSTOP) of its host's
    ranks (runtime.State.fence_silent: fencing.fence with stopped_only); one that runs (busy, or short of CPU under
    load) or waits is slow, not gone, and stays. ULFM's verdict (a rank declared failed) kills whatever its state."""
    import signal
    import subprocess
    import sys

    from hvdlite.core.fencing import Peer, fence, start_ticks, this_process

    code = {"busy": "while True: pass", "stopped": "while True: pass", "asleep": "import time; time.sleep(60)"}
    procs = {name: subprocess.Popen([sys.executable, "-c", text]) for name, text in code.items()}
    try:
        os.kill(procs["stopped"].pid, signal.SIGSTOP)  # (it stops once it next runs)
        wait_until(lambda: start_ticks(procs["stopped"].pid, stopped=True), "stopped")
        here = this_process()
        peers = [here] + [Peer(here.host, p.pid, start_ticks(p.pid)) for p in procs.values()] + [Peer("h2", 1, 1)]
        assert fence(range(5), peers, "is stopped", "then", stopped_only=True) == [2]
        assert procs["stopped"].wait(10) == -signal.SIGKILL and procs["busy"].poll() is procs["asleep"].poll() is None
        assert fence([1, 3], peers, "was declared failed", "then") == [1, 3]
        assert procs["busy"].wait(10) == procs["asleep"].wait(10) == -signal.SIGKILL
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_the_driver_ends_a_rank_of_its_host_stopped_for_4_s() -> None:
    """In-process mode: the driver ends a rank of its own host that stays stopped (SIGSTOP) for STOPPED_S (4 s),
    where every rank left of a job is stopped and none waits to kill it (inprocess.Losses.to_fence); a running or
    sleeping rank, a rank stopped less long, one that ended, or one of another host is left alone."""
    import signal
    import subprocess
    import sys

    from hvdlite.core.fencing import start_ticks
    from hvdlite.run.elastic.inprocess import STOPPED_S, Losses
    from hvdlite.run.elastic.server import RankInfo

    code = {"busy": "while True: pass", "stopped": "while True: pass", "asleep": "import time; time.sleep(60)"}
    procs = {name: subprocess.Popen([sys.executable, "-c", text]) for name, text in code.items()}
    try:
        os.kill(procs["stopped"].pid, signal.SIGSTOP)
        wait_until(lambda: start_ticks(procs["stopped"].pid, stopped=True), "stopped")
        here = socket.gethostname()
        ranks = [RankInfo(r, here, p.pid, 0) for r, p in enumerate(procs.values())]
        ranks += [RankInfo(3, "h2", procs["stopped"].pid, 0), RankInfo(4, here, procs["busy"].pid + 100000, 0, "lost")]
        losses = Losses(5)
        assert losses.to_fence(ranks, 100.0) == [] and losses.to_fence(ranks, 100.0 + STOPPED_S - 0.1) == []
        why = "has been stopped (SIGSTOP) for 4 s, and no rank ended it"
        assert losses.to_fence(ranks, 100.0 + STOPPED_S) == [(ranks[1], start_ticks(procs["stopped"].pid), why)]
        assert losses.to_fence(ranks, 200.0) == []  # once
        assert all(proc.poll() is None for proc in procs.values())  # (the caller, inprocess.fence, kills it)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()

