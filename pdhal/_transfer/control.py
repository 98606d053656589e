"""One control connection of a session: TCP, authenticated with the deployment's key, framed
messages (pdhal._transfer.messages) in both directions, and a liveness bound.

Authentication is multiprocessing.connection's HMAC challenge, both ways, before any message:
a peer without the key is dropped there. Liveness is a keepalive the caller bounds: each side
sends a Ping when it has sent nothing for a third of `keepalive` seconds, and a side that
hears nothing for `keepalive` seconds ends the link ("silent"). That catches what TCP alone
does not within seconds: a peer stopped (SIGSTOP, a hung host) whose kernel still
acknowledges, and a cut link (no FIN ever comes). The pings run on the session's deadline
clock (pdhal._transfer.keeper), the wait for a message is a poll bounded by the deadline:
no loop ticks.

A ControlLink reads on a thread of its own and hands each message to `on_message`, and its
end, once, to `on_lost(reason)`; send() is safe from any thread and never raises for a peer
that went (the link ends, on_lost says why)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from pdhal._errors import InvalidArgumentError, SessionError
from pdhal._transfer import checks, messages
from pdhal._transfer.keeper import Deadlines


def parse_address(address: object, what: str = "address") -> tuple[str, int]:
    """ "HOST:PORT" as (host, port); InvalidArgumentError naming `what` otherwise."""
    text = checks.name(address, what)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(f"{what} must be 'HOST:PORT', got {address!r}")
    return host.strip("[]"), int(port)


def dial(address: str, key: bytes, timeout: float) -> Connection:
    """A connection to `address`, both sides proven to hold `key`, within `timeout` s;
    SessionError saying why not."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise SessionError(f"cannot reach the session service at {address}: {e}") from None
    return _handshake(sock, key, timeout, dialled=True, peer=address)


def accept(sock: socket.socket, key: bytes, timeout: float, peer: str) -> Connection:
    """The accepted `sock` as a connection, both sides proven to hold `key` within `timeout`
    s (a peer that says nothing is dropped then); SessionError otherwise."""
    sock.settimeout(timeout)
    return _handshake(sock, key, timeout, dialled=False, peer=peer)


def _handshake(
    sock: socket.socket, key: bytes, timeout: float, *, dialled: bool, peer: str
) -> Connection:
    sock.settimeout(None)  # Connection reads the fd itself; the timer below bounds it
    _keepalive(sock, timeout)
    conn = Connection(sock.detach())
    timer = threading.Timer(timeout, conn.close)  # a silent peer: its reads fail then
    timer.daemon = True
    timer.start()
    try:
        if dialled:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
        else:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
    except AuthenticationError:
        conn.close()
        raise SessionError(
            f"the peer at {peer} does not hold this deployment's key (the session key)"
        ) from None
    except (OSError, EOFError, TypeError, ValueError) as e:  # closed by the timer, or reset
        conn.close()
        raise SessionError(
            f"the peer at {peer} did not complete the handshake within {timeout:g} s ({e!r})"
        ) from None
    finally:
        timer.cancel()
    return conn


def _keepalive(sock: socket.socket, bound: float) -> None:
    """TCP's own probes and a bound on unacknowledged data, so the kernel too gives up on a
    cut link (the pings find it first; this ends a send blocked on it)."""
    idle = max(1, int(bound / 3))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(bound * 1000)))


def read_message(conn: Connection, timeout: float) -> messages.Message:
    """The next message within `timeout` s (a handshake's hello or welcome); SessionError
    if none comes, the peer closes, or it is malformed."""
    try:
        if not conn.poll(timeout):
            raise SessionError(f"no message came within {timeout:g} s")
        return messages.decode(conn.recv_bytes(messages.MOST_BYTES))
    except (OSError, EOFError) as e:
        raise SessionError(f"the peer closed the connection ({e!r})") from None


class ControlLink:
    """A connection whose messages go to `on_message` (on the link's thread) until it ends,
    which `on_lost(reason)` hears once: the peer closed it, went silent for `keepalive` s,
    or sent a malformed message (refused: the reason is sent to it before the close)."""

    def __init__(
        self,
        conn: Connection,
        *,
        keepalive: float,
        clock: Deadlines,
        on_message: Callable[[messages.Message], None],
        on_lost: Callable[[str], None],
        name: str,
    ):
        self._conn = conn
        self.keepalive = keepalive
        self._clock = clock
        self._on_message, self._on_lost = on_message, on_lost
        self._lock = threading.Lock()  # one sender at a time; guards the state below
        self._sent = time.monotonic()
        self._ended = False
        self._pinger_at(self._sent + keepalive / 3)
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def send(self, message: messages.Message) -> None:
        """Send `message` (a link that ended drops it: on_lost said so)."""
        frame = messages.encode(message)
        with self._lock:
            if self._ended:
                return
            try:
                self._conn.send_bytes(frame)
                self._sent = time.monotonic()
                return
            except OSError as e:
                why = f"a send failed ({e!r})"
        self.end(why)

    @property
    def ended(self) -> bool:
        return self._ended

    def end(self, reason: str, *, tell: str | None = None) -> None:
        """End the link (once): `tell` goes to the peer first as a Refused, then the
        connection closes and on_lost(reason) runs."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            if tell is not None:
                try:
                    self._conn.send_bytes(messages.encode(messages.Refused(tell)))
                except OSError:
                    pass
            self._conn.close()  # the reader's next read fails: its thread ends
        self._on_lost(reason)

    def _pinger_at(self, when: float) -> None:
        self._clock.at(when, self._ping)

    def _ping(self) -> None:
        with self._lock:
            if self._ended:
                return
            due = self._sent + self.keepalive / 3
        if time.monotonic() >= due:
            self.send(messages.Ping())
            due = time.monotonic() + self.keepalive / 3
        self._pinger_at(due)

    def _read(self) -> None:
        while True:
            try:
                if not self._conn.poll(self.keepalive):
                    self.end(f"the peer said nothing for {self.keepalive:g} s (keepalive)")
                    return
                frame = self._conn.recv_bytes(messages.MOST_BYTES)
            except (OSError, EOFError, TypeError) as e:  # TypeError: closed under us
                self.end(f"the connection closed ({type(e).__name__})")
                return
            try:
                message = messages.decode(frame)
            except SessionError as e:
                self.end(f"the peer sent {e}", tell=f"you sent {e}")
                return
            if isinstance(message, messages.Refused):
                self.end(f"the peer ended the session: {message.reason}")
                return
            if not isinstance(message, messages.Ping):
                self._on_message(message)
