"""The control connections: prefill worker -> messager, decode worker -> messager.

Only block tables, the decode side's wants and the prefill side's completions go through
them; KV bytes and the decode side's outcomes move through pdhal.transfer's transport (shm
or Mooncake), layer progress through pdhal's signals. Every connection must
prove it holds the deployment's key (multiprocessing's HMAC challenge), so nothing else on
the network can join: the key is PDHAL_VLLM_KEY (hex) or the connector's `auth_key`.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from multiprocessing.connection import Client, Connection

KEY_VAR = "PDHAL_VLLM_KEY"


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


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit():
        raise ConnectorError(f"an address is HOST:PORT, got {text!r}")
    return host, int(port)


def connect(address: str, key: bytes, hello: dict, timeout: float = 30.0) -> Connection:
    """Connect to the messager at `address` (retrying while it starts) and say hello."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client((host, port), authkey=key)
            break
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if time.monotonic() > deadline:
                raise ConnectorError(
                    f"no messager answers at {address} after {timeout:.0f} s "
                    f"({exc}): start `python -m pdhal_vllm.messager` there"
                ) from None
            time.sleep(0.1)
        except EOFError:  # it went during the key's challenge (killed, restarting)
            raise ConnectorError(
                f"the messager at {address} closed the connection as it was made"
            ) from None
    try:
        conn.send(("hello", hello))
    except OSError as exc:
        conn.close()
        raise ConnectorError(f"the messager at {address} went before the hello ({exc})") from None
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
