"""The demo's control plane: the parent listens on loopback, each child process connects back.

Data never goes through here (KV blocks move through the transport, progress through pdhal);
only plans, readiness and timing events do. The listener binds 127.0.0.1 and every
connection must prove it knows a random key, so nothing else on the host can join.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

ADDRESS_VAR = "PDHAL_DEMO_CONTROL"
_GLOG_LINE = re.compile(r"[IWE]\d{4} |WARNING: Logging before InitGoogleLogging")
KEY_VAR = "PDHAL_DEMO_KEY"


class DemoError(Exception):
    """A failure the demo reports in one line and exits non-zero for."""


#: A control connection whose peer's host stops answering (a cut link) fails after this
#: long: keepalive probes after 2 s idle, 1 s apart, 3 of them; unacknowledged data, 5 s.
LINK_DEAD_S = 5


def _keepalive(link: Connection) -> None:
    """Make a lost peer host an error on `link` within LINK_DEAD_S, not a silent wait."""
    sock = socket.socket(fileno=os.dup(link.fileno()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LINK_DEAD_S * 1000)
    finally:
        sock.close()  # the duplicate only: the options belong to the socket


class Hub:
    """The parent's end: starts role processes and holds one connection to each. Every
    process of a run is launched first and accepted after, in whatever order the run sets
    them up: each spends its first seconds importing (Paddle), and those imports overlap.

    The listener binds `bind`: 127.0.0.1 unless a process runs on another host (then an
    address that host reaches, or 0.0.0.0, advertised as this host's name).
    """

    def __init__(self, bind: str = "127.0.0.1"):
        self._key = secrets.token_bytes(16)
        self._listener = Listener((bind, 0), authkey=self._key)
        self._advertise = socket.gethostname() if bind in ("0.0.0.0", "::") else bind
        self.links: dict[str, Connection] = {}
        self.processes: dict[str, subprocess.Popen] = {}
        #: Connections from launched processes not accepted yet (they came early).
        self._early: dict[str, Connection] = {}
        #: Each child's stderr (Mooncake logs there at INFO level, whatever it is told).
        self.logs = tempfile.TemporaryDirectory(prefix="pdhal-demo-")

    def child_env(self) -> dict[str, str]:
        """What a role process needs in its environment to connect here."""
        return {
            ADDRESS_VAR: f"{self._advertise}:{self._listener.address[1]}",
            KEY_VAR: self._key.hex(),
        }

    def launch(self, role: str, env: dict[str, str], pass_fds=()) -> None:
        """Launch `python -m pdhal_demo.child ROLE` with `env` (and the file descriptors
        `pass_fds`); accept() waits for it to connect. Its stdout and stderr go to its log:
        the parent's stdout carries only what `pdhal demo` prints (one JSON object with
        --json)."""
        with open(self.log_path(role), "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "pdhal_demo.child", role],
                env=env | self.child_env(),
                stdout=log,
                stderr=log,
                pass_fds=pass_fds,
            )
        self.processes[role] = process

    def accept(self, role: str, timeout: float) -> None:
        """Wait up to `timeout` s for `role` to connect (and, when this hub launched it,
        while its process lives); another launched process connecting meanwhile is kept
        for its own accept().

        Listener.accept cannot time out, so a watchdog thread, woken by the process's exit
        (its pidfd), the deadline or the connection coming, connects itself, with the key,
        and says why when it is not the connection.
        """
        if role in self._early:
            self.links[role] = self._early.pop(role)
            return
        process = self.processes.get(role)
        settled, settle = os.pipe()  # closing `settle` wakes the watchdog: connected
        exited = os.pidfd_open(process.pid) if process is not None else None

        def watchdog() -> None:
            try:
                woken = [settled] + ([exited] if exited is not None else [])
                ready, _, _ = select.select(woken, [], [], timeout)
                if settled in ready:
                    return
                why = (
                    f"the {role} exited before it connected"
                    if ready
                    else f"the {role} did not connect within {timeout:.0f} s"
                )
                with Client(self._listener.address, authkey=self._key) as link:
                    link.send(("abort", why))
            finally:
                os.close(settled)
                if exited is not None:
                    os.close(exited)

        threading.Thread(target=watchdog, name=f"pdhal-demo-accept-{role}", daemon=True).start()
        try:
            while True:
                try:
                    link = self._listener.accept()
                except AuthenticationError:
                    continue  # something without the key: not ours, keep waiting
                _keepalive(link)
                hello = link.recv()
                if hello[0] == "abort":
                    link.close()
                    raise DemoError(hello[1])
                if hello == ("hello", role):
                    self.links[role] = link
                    return
                other = hello[1] if hello[0] == "hello" else None
                if other not in self.processes or other in self.links or other in self._early:
                    link.close()
                    raise DemoError(f"expected the {role} to connect, got {hello!r}")
                self._early[other] = link
        finally:
            os.close(settle)

    def log_path(self, role: str) -> str:
        return os.path.join(self.logs.name, f"{role}.log")

    def log_tail(self, role: str, lines: int = 15) -> str:
        """The last lines a child wrote to stderr, without Mooncake's routine glog lines."""
        if role not in self.processes:
            return ""  # it runs elsewhere
        with open(self.log_path(role), errors="replace") as log:
            kept = [line for line in log if not _GLOG_LINE.match(line)]
        return "".join(kept[-lines:])

    def pid(self, role: str) -> int:
        return self.processes[role].pid

    def stop(self, grace: float) -> None:
        """Give the processes `grace` s to exit, terminate the rest, close the listener."""
        for link in [*self.links.values(), *self._early.values()]:
            try:
                link.send(("exit", {}))  # a process waiting for its next message stops
            except OSError:
                pass  # it has gone already
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for link in [*self.links.values(), *self._early.values()]:
            link.close()
        self._listener.close()
        self.logs.cleanup()


def configure_transport(name: str, host: str, protocol: str) -> None:
    """Give the mooncake transport this host's address and its protocol (the demo's --host
    and --protocol); the other transports take none of them."""
    if name == "mooncake":
        from pdhal import transfer

        transfer.transport("mooncake").configure(host=host, protocol=protocol)


def require_mooncake() -> None:
    """Return if the mooncake transport can run here, else raise a DemoError saying what to
    install."""
    from pdhal import transfer

    advice = (
        "the mooncake transport needs pdhal-mooncake and Mooncake's transfer engine: "
        "pip install 'pdhal-demo[mooncake]' (pdhal-mooncake[non-cuda])"
    )
    if "mooncake" not in transfer.transports():
        raise DemoError(advice)
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise DemoError(
                "Mooncake is installed but cannot load libibverbs.so.1: install "
                "Debian's libibverbs1 (apt-get install libibverbs1)"
            ) from None
        raise DemoError(advice) from None


class Outbox:
    """A child's events to the parent, sent in batches so the parent is not woken per layer.

    Waking the parent for every layer put a third runnable process on a two-core machine
    exactly while the worker computes and the messager copies. `post` queues an event;
    `flush` sends the queue as one ("events", [...]) message, `send` flushes then sends one
    message now (for what the parent must act on at once: a request fully sent, an error).
    `due` flushes when the oldest queued event is `interval_ns` old (for live progress).
    Safe to use from several threads.
    """

    def __init__(self, link: Connection, interval_ns: int = 100_000_000):
        self.link = link
        self._interval = interval_ns
        self._queue: list[tuple[str, dict]] = []
        self._since = 0
        self._lock = threading.Lock()

    def post(self, kind: str, payload: dict) -> None:
        with self._lock:
            if not self._queue:
                self._since = time.monotonic_ns()
            self._queue.append((kind, payload))

    def due(self) -> None:
        if self._queue and time.monotonic_ns() - self._since >= self._interval:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def send(self, kind: str, payload: dict) -> None:
        with self._lock:
            self._flush()
            self.link.send((kind, payload))

    def _flush(self) -> None:
        if self._queue:
            self.link.send(("events", self._queue))
            self._queue = []


def connect(role: str) -> Connection:
    """The child's end: connect to the parent named in the environment."""
    host, port = os.environ[ADDRESS_VAR].rsplit(":", 1)
    link = Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_VAR]))
    _keepalive(link)
    link.send(("hello", role))
    return link
