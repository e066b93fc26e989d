"""The elastic driver's TCP endpoint, where its ranks (and a standby job's, waiting) stay connected: a connection
closing without "done" or "resize" is a lost rank; only messages signed with the run's secret count (see link.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hmac
import json
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from hvdlite.core.launch import signature

#: The names that mean this machine in a host list.
LOCAL_NAMES = ("localhost", "127.0.0.1")
#: A rank's messages are a few hundred bytes; a longer line is refused without being kept.
MAX_MESSAGE_BYTES = 1 << 16
_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of a network interface


def interface_address(nic: str) -> str:
    """The IPv4 address of network interface ``nic`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", nic[:15].encode()))
        except OSError as exc:
            raise OSError(f"network interface {nic!r} has no IPv4 address here ({exc.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def is_local(host: str) -> bool:
    """Whether ``host`` in a host list names this machine."""
    return host in (socket.gethostname(), *LOCAL_NAMES)


def bind_address(hosts: Sequence[str], nics: Sequence[str]) -> str:
    """The address the driver listens on for a job on ``hosts``: loopback when every host is this machine;
    else the address of the first of ``nics`` (--network-interface), or of the interface that routes to
    the first other host."""
    others = [h for h in hosts if not is_local(h)]
    if not others:
        return "127.0.0.1"
    if nics:
        return interface_address(nics[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((others[0], 9))  # picks the route; sends nothing
        return str(sock.getsockname()[0])


@dataclasses.dataclass
class RankInfo:
    rank: int
    host: str
    pid: int
    attempt: int
    ended: str = ""  # "", "done", "resize", "lost"
    ended_at: float = 0.0
    recovered: tuple[int, ...] = ()  # in-process mode: the job's size after each recovery this rank reported
    #: and the (host, pid, start ticks) of the ranks it lost, or found silent (its stall inspector's verdict)
    declared_lost: tuple[tuple[str, int, int], ...] = ()


class DriverServer:
    """Accepts rank connections in a background thread; the driver reads what happened per attempt."""

    def __init__(self, log: Callable[[str], None], secret: str, bind: str = "127.0.0.1") -> None:
        self._log = log
        self._secret = secret
        self.address = bind
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self._sock.listen(256)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self.generation = 0
        self.attempt = 0
        self.ranks: dict[int, RankInfo] = {}
        self.joined_any = False  # a rank of some attempt said hello: the program uses hvd.elastic.run
        self._standing: set[socket.socket] = set()  # the connections of the standby job's waiting ranks
        self._conns: dict[socket.socket, dict[str, Any]] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="hvdlite-elastic-driver", daemon=True)
        self._thread.start()

    def new_attempt(self, attempt: int) -> None:
        with self._lock:
            self.attempt = attempt
            self.ranks = {}

    def bump_generation(self) -> int:
        with self._lock:
            self.generation += 1
            return self.generation

    def snapshot(self) -> list[RankInfo]:
        with self._lock:
            return [dataclasses.replace(info) for info in self.ranks.values()]

    def standing_by(self) -> int:
        """How many ranks of the standby job wait at hvd.elastic.run's connect."""
        with self._lock:
            return len(self._standing)

    def release(self, restart: int) -> None:
        """Hand the run over to the standby job: its waiting ranks go on as the job of reset ``restart``."""
        with self._lock:
            line = (json.dumps({"restart": restart, "generation": self.generation}) + "\n").encode()
            waiting, self._standing = self._standing, set()
        for conn in waiting:
            with contextlib.suppress(OSError):
                self._send(conn, line)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self._sock.close()

    # -- the serving thread ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self._sock:
                    try:
                        conn, addr = self._sock.accept()
                        nonce = secrets.token_hex(16)
                        conn.sendall((json.dumps({"nonce": nonce}) + "\n").encode())  # a few bytes: no wait
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._conns[conn] = {"buffer": b"", "info": None, "nonce": nonce, "seq": 0,
                                         "peer": "%s:%s" % addr[:2]}
                    self._selector.register(conn, selectors.EVENT_READ)
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, conn: socket.socket) -> None:
        state = self._conns[conn]
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._closed(conn, state)
            return
        state["buffer"] += data
        if len(state["buffer"]) > MAX_MESSAGE_BYTES and b"\n" not in state["buffer"]:
            state["buffer"] = b"{}\n"  # no rank sends that much: refused below, as unsigned
        while b"\n" in state["buffer"]:
            line, state["buffer"] = state["buffer"].split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                msg = {}
            if not isinstance(msg, dict) or not self._authentic(state, msg):
                self._log(f"refused a connection from {state['peer']}: its message is not signed with this "
                          f"job's secret (only the processes this driver starts have it)")
                self._closed(conn, state)
                return
            try:
                self._handle(conn, state, msg)
            except (ValueError, KeyError, OSError) as exc:
                self._log(f"ignoring a bad message from a rank: {exc}")

    def _authentic(self, state: dict[str, Any], msg: dict[str, Any]) -> bool:
        """Whether ``msg`` is signed with the secret for this connection's nonce, next in sequence."""
        mac = msg.get("mac")
        if not isinstance(mac, str) or msg.get("seq") != state["seq"] + 1:
            return False
        expected = signature(self._secret, state["nonce"], msg)
        if not hmac.compare_digest(mac.encode("utf-8", "replace"), expected.encode()):
            return False
        state["seq"] += 1
        return True

    def _handle(self, conn: socket.socket, state: dict[str, Any], msg: dict[str, Any]) -> None:
        op, info = msg.get("op"), state["info"]
        if op == "hello":
            info = RankInfo(rank=int(msg["rank"]), host=str(msg["host"]), pid=int(msg["pid"]),
                            attempt=int(msg.get("attempt", -1)))
            state["info"] = info
            with self._lock:
                current = info.attempt == self.attempt
                if current:
                    self.ranks[info.rank] = info
                self.joined_any = True
            if current:
                self._log(f"rank {info.rank} of {msg.get('size')} joined from host {info.host} (pid {info.pid})")
        elif op == "standby":  # a standby job's rank, waiting for the handover (release)
            with self._lock:
                self._standing.add(conn)
        elif op == "generation":
            with self._lock:
                generation = self.generation
            self._send(conn, (json.dumps({"generation": generation}) + "\n").encode())
        elif op in ("done", "resize") and info is not None:
            with self._lock:
                info.ended, info.ended_at = op, time.monotonic()
        elif op in ("recovered", "silent") and info is not None:  # silent: ranks the stall inspector gave up on,
            peers = msg.get("lost_peers" if op == "recovered" else "peers", ())  # on other hosts
            with self._lock:
                if op == "recovered":
                    info.recovered = (*info.recovered, int(msg["size"]))
                info.declared_lost = (*info.declared_lost, *((str(h), int(p), int(t)) for h, p, t in peers))
        elif op == "log" and info is not None and info.attempt == self.attempt:
            self._log(f"rank {info.rank}: {msg.get('text')}")

    @staticmethod
    def _send(conn: socket.socket, line: bytes) -> None:
        conn.setblocking(True)
        conn.sendall(line)
        conn.setblocking(False)

    def _closed(self, conn: socket.socket, state: dict[str, Any]) -> None:
        self._selector.unregister(conn)
        del self._conns[conn]
        conn.close()
        info = state["info"]
        with self._lock:
            self._standing.discard(conn)
            if info is not None and not info.ended:
                info.ended, info.ended_at = "lost", time.monotonic()
