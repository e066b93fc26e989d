"""The elastic driver's endpoint, in one process: it listens on loopback for a job on this machine, and only
messages signed with the job's secret count; a rank's link signs with the secret from its environment."""
from __future__ import annotations

import json
import socket

import pytest

from cluster.elastic import wait_until
from hvdlite.core.elastic.link import DriverLink
from hvdlite.core.elastic_wire import DRIVER_VARIABLE, SECRET_VARIABLE, signature
from hvdlite.run.elastic.server import DriverServer, bind_address, new_secret


@pytest.fixture
def server():
    logged: list[str] = []
    srv = DriverServer(logged.append, new_secret())
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
    assert server.snapshot() == [] and server.first_lost() is None  # nothing registered, nothing lost
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
