"""What the connector's processes share: its errors, the deployment's key, the prefill
worker's link to its messager, and the trace.

A decode worker and a messager speak pdhal's session protocol (pdhal.transfer.DecodeClient,
PrefillService; docs/session-protocol.md) at the messager's address. The prefill worker and
its messager (one host: the messager maps the worker's KV cache) speak over a local socket
named by that address (`worker_address`): the worker's hello (its KV cache and layout), each
step's table, and each transfer's end, as JSON (a WorkerLink). Both ask for the deployment's
key: PDHAL_VLLM_KEY (hex) or the connector's `auth_key`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time

from pdhal import PdhalError
from pdhal.transfer import Frames, authenticate

KEY_VAR = "PDHAL_VLLM_KEY"
#: The control sessions' liveness bound (s) by default (the decode workers'
#: `keepalive_s`, the messager's --keepalive): a side silent this long is gone. Generous: a
#: vLLM worker's threads can be starved for seconds on a loaded host, and a false end
#: fails every request of that session.
KEEPALIVE_S = 15.0
#: How long each end of a worker's link has to prove it holds the key.
HANDSHAKE_S = 10.0
#: The largest message on a worker's link (a step's table of requests).
MOST_BYTES = 16 << 20


class ConnectorError(RuntimeError):
    """A failure of the pdhal connector, said in one line."""


def auth_key(explicit: str | None = None) -> bytes:
    """The deployment's key: `explicit` or PDHAL_VLLM_KEY, as hex."""
    raw = explicit or os.environ.get(KEY_VAR)
    if not raw:
        raise ConnectorError(
            f"no key for the messager's control connections: set {KEY_VAR} "
            f"(the same hex string on the prefill host, the decode host and "
            f"for the messager), e.g. `export {KEY_VAR}=$(openssl rand -hex 16)`"
        )
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise ConnectorError(f"{KEY_VAR} must be a hex string, got {raw!r}") from None


def transport_options(given: list[str]) -> dict[str, str]:
    """A transport's options from command-line KEY=VALUE words (Transport.configure)."""
    options = {}
    for word in given:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ConnectorError(f"a transport option is KEY=VALUE, got {word!r}")
        options[key] = value
    return options


def checked_address(value: object, what: str) -> str:
    """`value` if it is a 'HOST:PORT' string; ConnectorError naming `what` otherwise."""
    if not isinstance(value, str):
        raise ConnectorError(f"{what} must be 'HOST:PORT', got {value!r}")
    try:
        parse_address(value)
    except ConnectorError as e:
        raise ConnectorError(f"{what}: {e}") from None
    return value


#: The longest bound taken, in seconds.
DAY = 86400


def checked_seconds(value: object, what: str) -> float:
    """`value` if it is a number of seconds in (0, DAY]; ConnectorError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= DAY:
        raise ConnectorError(f"{what} must be a number of seconds in (0, {DAY}], got {value!r}")
    return value


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConnectorError(f"an address is HOST:PORT (a port of 0-65535), got {text!r}")
    return host, int(port)


def reserve(address: str) -> tuple[socket.socket, str]:
    """A socket holding `address`'s port (port 0: a free one) for the caller's life, and
    the address it holds: bound, never listening, with address reuse, so that a service
    made there later (pdhal.transfer.PrefillService, which allows reuse too) can listen on
    it each time, and nothing else takes the port in between."""
    host, port = parse_address(address)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind((host, port))
    except OSError as exc:
        holder.close()
        raise ConnectorError(f"cannot listen on {address}: {exc}") from None
    return holder, f"{host}:{holder.getsockname()[1]}"


def worker_address(address: str) -> str:
    """The local socket of the messager serving decode workers at `address`, where its
    prefill worker connects (an abstract AF_UNIX name: nothing on disk to leave behind)."""
    host, port = parse_address(address)
    return f"\0pdhal-vllm-messager/{host}:{port}"


class WorkerLink:
    """A prefill worker's local link to its messager, at either end: messages are JSON
    lists whose first item is their kind, each in one frame of at most MOST_BYTES, sent
    once both ends proved they hold the deployment's key (pdhal.transfer.authenticate).
    Nothing a peer sends is run (no pickle), and every wait but receive()'s is bounded."""

    def __init__(self, frames: Frames):
        self._frames = frames
        self._lock = threading.Lock()  # one message at a time, from any thread

    @classmethod
    def accepted(cls, sock: socket.socket, key: bytes) -> WorkerLink:
        """The link of a connection the messager accepted, once the worker proved it holds
        `key` within HANDSHAKE_S; ConnectorError otherwise (the socket is closed then)."""
        try:
            return cls(authenticate(sock, key, HANDSHAKE_S, "a prefill worker", dialled=False))
        except PdhalError as exc:
            raise ConnectorError(str(exc)) from None

    def send(self, *message, within: float = KEEPALIVE_S) -> None:
        """Send `message` (its kind, then its items) whole within `within` s;
        ConnectorError if the other end did not read it (or went)."""
        frame = json.dumps(message).encode()
        with self._lock:
            try:
                self._frames.write(frame, within)
            except PdhalError as exc:
                raise ConnectorError(str(exc)) from None

    def receive(self, within: float | None = None) -> list | None:
        """The next message (a non-empty list); None if none began within `within` s (None:
        wait as long as it takes). ConnectorError if the other end went or sent what is
        not a message."""
        try:
            frame = self._frames.read(within, HANDSHAKE_S, most=MOST_BYTES)
        except PdhalError as exc:
            raise ConnectorError(str(exc)) from None
        if frame is None:
            return None
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError):  # (UnicodeDecodeError; nesting past the stack)
            raise ConnectorError(f"a message that is not JSON: {frame[:80]!r}") from None
        if not isinstance(message, list) or not message or not isinstance(message[0], str):
            raise ConnectorError(f"{message!r:.80} is not a message: a list, its kind first")
        return message

    def close(self) -> None:
        self._frames.close()


def listen_workers(address: str) -> socket.socket:
    """The messager's local socket for its prefill worker, at `worker_address(address)`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(worker_address(address))
    except OSError as exc:
        sock.close()
        raise ConnectorError(f"another messager serves {address} on this host ({exc})") from None
    sock.listen()
    return sock


def peer_process(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of local socket `sock`, as the kernel
    knows them (SO_PEERCRED: nothing the peer says)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def connect_worker(address: str, key: bytes, hello: dict, timeout: float) -> WorkerLink:
    """The prefill worker's link to the messager at `address` (retried for `timeout` s
    while none listens), its hello sent."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(worker_address(address))
            break
        except OSError as exc:  # none listens (yet), or its backlog is full: tried again
            sock.close()
            if time.monotonic() > deadline:
                raise ConnectorError(
                    f"no messager answers for {address} after {timeout:.0f} s ({exc}): start "
                    f"`python -m pdhal_vllm.messager --listen {address}` on this host"
                ) from None
            time.sleep(0.1)
    try:
        link = WorkerLink(
            authenticate(sock, key, HANDSHAKE_S, f"the messager for {address}", dialled=True)
        )
        link.send("hello", hello, within=HANDSHAKE_S)
    except (PdhalError, ConnectorError) as exc:
        sock.close()
        why = f"the messager for {address} did not take this worker: {exc}"
        raise ConnectorError(why) from None
    return link


class Tracer:
    """JSON lines of what a process did, with CLOCK_MONOTONIC times (one host-wide clock),
    for tests and the benchmark; off unless a path is given."""

    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self._file is not None

    def __call__(self, kind: str, **fields) -> None:
        if self._file is None:
            return
        fields["kind"] = kind
        fields.setdefault("t", time.monotonic_ns())
        fields["pid"] = os.getpid()
        line = json.dumps(fields)
        with self._lock:
            self._file.write(line + "\n")


def read_trace(path: str) -> list[dict]:
    """Every event of a trace file, in the order written."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
