"""What the connector's processes share: its errors, the deployment's key, the prefill
worker's link to its messager, and the trace.

A decode worker and a messager speak pdhal's session protocol (pdhal.transfer.DecodeClient,
PrefillService; docs/session-protocol.md) at the messager's address. The prefill worker and
its messager (one host: the messager maps the worker's KV cache) speak over a local socket
named by that address (`worker_address`): the worker's hello (its KV cache and layout), each
step's table, and each transfer's end. Both ask for the deployment's key: PDHAL_VLLM_KEY
(hex) or the connector's `auth_key`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import zlib
from multiprocessing.connection import Client, Connection

KEY_VAR = "PDHAL_VLLM_KEY"
#: The control sessions' liveness bound (s) by default (the decode workers'
#: `keepalive_s`, the messager's --keepalive): a side silent this long is gone. Generous: a
#: vLLM worker's threads can be starved for seconds on a loaded host, and a false end
#: fails every request of that session.
KEEPALIVE_S = 15.0


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


def connect_worker(address: str, key: bytes, hello: dict, timeout: float) -> Connection:
    """The prefill worker's link to the messager at `address` (retrying while it starts),
    its hello sent."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client(worker_address(address), family="AF_UNIX", authkey=key)
            break
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if time.monotonic() > deadline:
                raise ConnectorError(
                    f"no messager answers for {address} after {timeout:.0f} s ({exc}): start "
                    f"`python -m pdhal_vllm.messager --listen {address}` on this host"
                ) from None
            time.sleep(0.1)
        except EOFError:  # it went during the key's challenge (killed, restarting)
            raise ConnectorError(
                f"the messager for {address} closed the connection as it was made"
            ) from None
    try:
        conn.send(("hello", hello))
    except OSError as exc:
        conn.close()
        raise ConnectorError(f"the messager for {address} went before the hello ({exc})") from None
    return conn


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


def head_crcs(block, heads: int) -> list[int]:
    """crc32 of each of a head-major block's `heads` equal parts (tests: the bytes of each
    KV head, wherever the tensor-parallel split of a side put it)."""
    data = memoryview(block).cast("B")
    size = len(data) // heads
    return [zlib.crc32(data[h * size : (h + 1) * size]) for h in range(heads)]
