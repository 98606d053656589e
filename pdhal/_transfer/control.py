"""One control connection of a session: TCP, authenticated with the deployment's key, framed
messages (pdhal._transfer.messages) in both directions, and a liveness bound.

Frames: a 4-byte big-endian length, then that many bytes. Authentication, before any
message: each side sends a random challenge and answers the other's with its HMAC-SHA256
under the key; a peer without it is dropped there. Every read is bounded: a handshake by
its timeout, a frame by the keepalive bound from its first byte (a peer that sends half a
frame and stops is as silent as one that sends nothing).

Liveness is a keepalive the caller bounds: each side sends a Ping when it has sent nothing
for a third of `keepalive` seconds, and a side that hears nothing for `keepalive` seconds
ends the link ("silent"). That catches what TCP alone does not within seconds: a peer
stopped (SIGSTOP, a hung host) whose kernel still acknowledges, and a cut link.

A ControlLink has two threads. Its reader hands each message to `on_message` and, once the
link ended (for whatever reason, from whichever thread), calls `on_lost(reason)` exactly
once, itself, never inside another caller's call: a handler may end the link while holding
its own locks. Its writer sends what send() queued (send never blocks: a peer that does not
read for `keepalive` seconds, or lets MOST_QUEUED frames pile up, ends the link) and the
pings."""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from pdhal._errors import InvalidArgumentError, SessionError
from pdhal._transfer import checks, messages

log = logging.getLogger("pdhal")

#: The handshake's challenge bytes.
CHALLENGE_BYTES = 32  # (an HMAC-SHA256 proof is as long)
#: Frames a link keeps queued for a peer that does not read them, at most.
MOST_QUEUED = 65536
_HEADER = struct.Struct("!I")


class Malformed(SessionError):
    """What the peer sent breaks the protocol (it is told so before the close)."""


def parse_address(address: object, what: str = "address") -> tuple[str, int]:
    """ "HOST:PORT" as (host, port); InvalidArgumentError naming `what` otherwise."""
    text = checks.name(address, what)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(f"{what} must be 'HOST:PORT', got {address!r}")
    return host.strip("[]"), int(port)


class Frames:
    """A socket's frames: whole reads and writes, each bounded in time."""

    def __init__(self, sock: socket.socket, peer: str):
        sock.setblocking(False)
        self.sock, self.peer = sock, peer

    def read(
        self, first_within: float | None, whole_within: float, most: int = messages.MOST_BYTES
    ) -> bytes | None:
        """The next frame; None if none began within `first_within` s (None: wait for one
        as long as it takes). SessionError if the peer closed, sent a frame over `most`
        bytes, or did not finish it within `whole_within` s of its first byte."""
        header = self._read(_HEADER.size, first_within, whole_within)
        if header is None:
            return None
        (size,) = _HEADER.unpack(header)
        if size > most:
            raise Malformed(f"a frame of {size} bytes (at most {most})")
        return self._read(size, whole_within, whole_within, started=True) if size else b""

    def _read(
        self, n: int, first: float | None, whole: float, started: bool = False
    ) -> bytes | None:
        chunks, got = [], 0
        bound = whole if started else first
        deadline = None if bound is None else time.monotonic() + bound
        while got < n:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self._ready(left, reading=True):
                if not got and not started:
                    return None
                raise SessionError(f"the peer sent part of a frame and stopped for {whole:g} s")
            try:
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                raise SessionError(f"the connection failed ({e})") from None
            if not chunk:
                raise SessionError("the peer closed the connection")
            if not got and not started:
                deadline = time.monotonic() + whole  # a frame began: it has `whole` s
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def write(self, frame: bytes, within: float) -> None:
        """Send `frame` whole within `within` s; SessionError otherwise. What the socket
        takes at once is sent however late the caller is (a thread descheduled past its
        bound on a loaded machine still says its last words); only waiting is bounded."""
        data = memoryview(_HEADER.pack(len(frame)) + frame)
        deadline = time.monotonic() + within
        while data:
            try:
                data = data[self.sock.send(data) :]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                raise SessionError(f"a send failed ({e})") from None
            left = deadline - time.monotonic()
            if left <= 0 or not self._ready(left, reading=False):
                raise SessionError(f"the peer read nothing for {within:g} s")

    def _ready(self, within: float | None, *, reading: bool) -> bool:
        """Whether the socket can be read (or written) within `within` s (None: once it
        can); SessionError once it was closed under the caller (close() from another
        thread). poll, not select: an engine's process holds thousands of descriptors, and
        select takes none numbered 1024 or more."""
        fd = self.sock.fileno()
        if fd < 0:
            raise SessionError("the connection was closed")
        waiter = select.poll()
        waiter.register(fd, select.POLLIN if reading else select.POLLOUT)
        try:
            events = waiter.poll(None if within is None else math.ceil(max(within, 0) * 1000))
        except OSError:
            raise SessionError("the connection was closed") from None
        if any(mask & select.POLLNVAL for _, mask in events):
            raise SessionError("the connection was closed")
        return bool(events)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked on it
        except OSError:
            pass
        self.sock.close()


def dial(address: str, key: bytes, timeout: float) -> Frames:
    """A connection to `address`, both sides proven to hold `key`, within `timeout` s;
    SessionError saying why not."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except (OSError, UnicodeError) as e:  # (UnicodeError: a host name idna refuses)
        raise SessionError(f"cannot reach the session service at {address}: {e}") from None
    return authenticate(sock, key, timeout, address, dialled=True)


def accept(sock: socket.socket, key: bytes, timeout: float, peer: str) -> Frames:
    """The accepted `sock`, both sides proven to hold `key` within `timeout` s (a peer that
    says nothing is dropped then); SessionError otherwise."""
    return authenticate(sock, key, timeout, peer, dialled=False)


def _proof(key: bytes, role: bytes, challenges: tuple[bytes, bytes]) -> bytes:
    """HMAC-SHA256 under `key` of the prover's role and both challenges (the dialler's
    first): an answer made for one role or one connection proves nothing on another, so
    a peer without the key cannot reflect a side's own answer back to it."""
    return hmac.new(key, role + challenges[0] + challenges[1], hashlib.sha256).digest()


def authenticate(
    sock: socket.socket, key: bytes, timeout: float, peer: str, *, dialled: bool
) -> Frames:
    """The frames of connected `sock` (TCP or a local socket) once both sides proved they
    hold `key` within `timeout` s; SessionError naming `peer` otherwise (the socket is
    closed then). Both sides send a challenge; the dialler (`dialled`) proves it holds
    `key` first, and only then does the acceptor prove it (so an acceptor answers nothing
    to a peer without the key); each proof covers the prover's role and both challenges
    (_proof)."""
    _keepalive(sock, timeout)
    frames = Frames(sock, peer)
    deadline = time.monotonic() + timeout
    mine = os.urandom(CHALLENGE_BYTES)

    def read_proof(what: str) -> bytes:
        left = max(deadline - time.monotonic(), 0.0)
        got = frames.read(left, left, most=CHALLENGE_BYTES)
        if got is None or len(got) != CHALLENGE_BYTES:
            raise SessionError(f"no {what} came within {timeout:g} s")
        return got

    try:
        frames.write(mine, timeout)
        theirs = read_proof("challenge")
        challenges = (mine, theirs) if dialled else (theirs, mine)
        ours = _proof(key, b"dial" if dialled else b"accept", challenges)
        expected = _proof(key, b"accept" if dialled else b"dial", challenges)
        if dialled:
            frames.write(ours, timeout)
            try:
                answer = read_proof("proof")
            except SessionError as e:
                raise SessionError(
                    f"the peer at {peer} refused this side's proof: it does not hold this "
                    f"deployment's key ({e})"
                ) from None
        else:  # the dialler's proof first: nothing of ours goes to a peer without the key
            answer = read_proof("proof")
            if hmac.compare_digest(answer, expected):
                frames.write(ours, timeout)
    except SessionError as e:
        frames.close()
        raise SessionError(f"the handshake with {peer} failed: {e}") from None
    if not hmac.compare_digest(answer, expected):
        frames.close()
        raise SessionError(f"the peer at {peer} does not hold this deployment's key")
    return frames


def _keepalive(sock: socket.socket, bound: float) -> None:
    """TCP's own probes and a bound on unacknowledged data, so the kernel too gives up on a
    cut link (a local socket has no link to cut)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = max(1, int(bound / 3))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(bound * 1000)))


def read_message(frames: Frames, timeout: float) -> messages.Message:
    """The next message within `timeout` s (a hello or its answer); SessionError if none
    comes, the peer closes, or it is malformed."""
    frame = frames.read(timeout, timeout)
    if frame is None:
        raise SessionError(f"no message came within {timeout:g} s")
    return messages.decode(frame)


def write_message(frames: Frames, message: messages.Message, timeout: float) -> None:
    frames.write(messages.encode(message), timeout)


class ControlLink:
    """A connection whose messages go to `on_message` (on the link's reader thread) until
    it ends, which `on_lost(reason)` hears once, on that thread: the peer closed it, went
    silent for `keepalive` s, did not read, or sent a malformed message (refused: the
    reason is sent to it before the close). It pings when it has sent nothing for a third
    of the smaller of `keepalive` and the peer's (`peer_keepalive`)."""

    def __init__(
        self,
        frames: Frames,
        *,
        keepalive: float,
        peer_keepalive: float,
        on_message: Callable[[messages.Message], None],
        on_lost: Callable[[str], None],
        name: str,
    ):
        self._frames = frames
        self.keepalive = keepalive
        self._ping_every = min(keepalive, peer_keepalive) / 3
        self._on_message, self._on_lost = on_message, on_lost
        self._cond = threading.Condition()  # guards the queue and the end
        self._queue: collections.deque[bytes] = collections.deque()
        self._ended: str | None = None  # why, once it ended
        self._tell: bytes | None = None  # the Refused to send before the close
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"{name}-out", daemon=True)

    def start(self) -> None:
        """Start writing and reading (once whatever on_message needs is in place)."""
        self._writer.start()  # first: the reader joins it when the link ends
        self._reader.start()

    @property
    def ended(self) -> bool:
        return self._ended is not None

    def send(self, message: messages.Message) -> None:
        """Queue `message` (never blocks; a link that ended drops it: on_lost says so)."""
        frame = messages.encode(message)
        with self._cond:
            if self._ended is not None:
                return
            if len(self._queue) >= MOST_QUEUED:
                self._end(f"the peer let {MOST_QUEUED} messages pile up unread")
                return
            self._queue.append(frame)
            self._cond.notify_all()

    def end(self, reason: str, *, tell: str | None = None) -> None:
        """End the link (once): with `tell`, what is queued and then `tell` as a Refused go
        to the peer first (within a moment), then the connection closes; on_lost(reason)
        follows on the reader."""
        with self._cond:
            if tell is not None and self._ended is None:
                self._tell = messages.encode(messages.Refused(tell))
            self._end(reason)

    def wait_closed(self) -> None:
        """Return once the connection closed after end(): its last words written or given
        up (within the writer's own bounds: `keepalive` s for a frame under way, then a
        moment). A process that exits right after end() would lose them otherwise."""
        if self._writer.ident is not None:  # (a link never started has nothing queued)
            self._writer.join()

    def _end(self, reason: str) -> None:
        """(under self._cond)"""
        if self._ended is not None:
            return
        self._ended = reason
        self._cond.notify_all()
        if self._tell is None:
            self._frames.close()  # the reader's wait ends; the writer sees _ended
        # else the writer sends it, then closes

    def _write(self) -> None:
        """Send what is queued, a ping when nothing was sent for _ping_every s."""
        every = self._ping_every
        while True:
            with self._cond:
                deadline = time.monotonic() + every
                while not self._queue and self._ended is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._ended is not None:
                    tell = self._tell
                    last = list(self._queue) if tell is not None else []
                    break
                frame = self._queue.popleft() if self._queue else messages.encode(messages.Ping())
            try:
                self._frames.write(frame, self.keepalive)
            except SessionError as e:
                with self._cond:
                    self._end(f"sending to the peer failed: {e}")
                return
        if tell is not None:  # the last words, all within one bound
            deadline = time.monotonic() + min(1.0, self.keepalive)
            try:
                for frame in (*last, tell):
                    self._frames.write(frame, max(0.001, deadline - time.monotonic()))
            except SessionError:
                pass
            self._frames.close()

    def _read(self) -> None:
        while self._ended is None:
            frame = None
            try:
                frame = self._frames.read(self.keepalive, self.keepalive)
                if frame is None:
                    self.end(f"the peer said nothing for {self.keepalive:g} s (keepalive)")
                    break
                message = messages.decode(frame)
            except Malformed as e:
                self.end(f"the peer sent {e}", tell=f"you sent {e}")
                break
            except SessionError as e:  # messages.decode's refusals are the peer's too
                if frame is not None and self._ended is None:
                    self.end(f"the peer sent {e}", tell=f"you sent {e}")
                else:
                    self.end(str(e))
                break
            if isinstance(message, messages.Refused):
                self.end(f"the peer ended the session: {message.reason}")
                break
            if isinstance(message, messages.Ping):
                continue
            try:
                self._on_message(message)
            except Exception as e:  # a handler's bug ends this link, not the reader silently
                log.exception("pdhal.transfer: a session message's handler raised")
                self.end(f"handling a {message.TYPE} failed here: {type(e).__name__}: {e}")
        self._writer.join(2 * self.keepalive)  # its Refused goes before the close
        self._frames.close()
        self._on_lost(self._ended or "the link ended")
