"""How the messager moves blocks into a decode instance's KV cache: `shm` or `mooncake`.

A decode worker makes its cache reachable (`DecodeEndpoint`) and hands the messager a
`describe()` dict; the messager opens a writer on it (`open_writer`). A writer copies runs
(source offset, destination offset, bytes) from the prefill cache, whose address in the
messager is `src_base`, and returns once they are in the decode cache.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from pdhal import ops
from pdhal_vllm.wire import ConnectorError

TRANSPORTS = ("shm", "mooncake")
Run = tuple[int, int, int]  # (source byte offset, destination byte offset, bytes)


def require_mooncake():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise ConnectorError(
                "Mooncake is installed but cannot load libibverbs.so.1: "
                "install Debian's libibverbs1"
            ) from None
        raise ConnectorError(
            "the mooncake transport needs Mooncake's transfer engine: "
            "pip install 'pdhal-vllm[mooncake]'"
        ) from None
    return TransferEngine


class MooncakeEngine:
    """One Mooncake transfer engine with P2PHANDSHAKE (no metadata server). Its RPC port
    listens on every interface whatever `host` says: firewall it on a shared network."""

    def __init__(self, host: str, protocol: str):
        self.engine = require_mooncake()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise ConnectorError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed ({rc})"
            )
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, address: int, nbytes: int) -> None:
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise ConnectorError(
                f"Mooncake could not register {nbytes} bytes at {address:#x} ({rc})"
            )


class DecodeEndpoint:
    """The decode worker's end: its whole KV buffer, reachable by the messager."""

    def __init__(
        self,
        transport: str,
        tensor,
        nbytes: int,
        name: str,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
    ):
        if transport not in TRANSPORTS:
            raise ConnectorError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self._describe = {"transport": transport, "nbytes": nbytes}
        if transport == "shm":
            ops.set_data_ipc(tensor, name)
            self._describe["name"] = name
        else:
            self._engine = MooncakeEngine(host, protocol)
            address = ops.get_peer_mem_addr(tensor)
            self._engine.register(address, nbytes)
            self._describe |= {"session": self._engine.session, "address": address}

    def describe(self) -> dict:
        return dict(self._describe)


class ShmWriter:
    """memmove into the decode cache mapped from pdhal shared memory (one host)."""

    def __init__(self, describe: dict, timeout: float = 10.0):
        self.dst = ops.share_external_data("uint8", describe["name"], [describe["nbytes"]], timeout)
        self._dst_base = self.dst.ctypes.data
        self.nbytes = describe["nbytes"]

    def write(self, src_base: int, runs: list[Run]) -> None:
        memmove, dst = ctypes.memmove, self._dst_base
        for s, d, n in runs:
            memmove(dst + d, src_base + s, n)

    def close(self) -> None:
        pass  # the mapping stays for the process's life (pdhal's cpu backend keeps it)


class MooncakeWriter:
    """Mooncake writes from the registered prefill cache into the registered decode cache.

    One transfer_submit_write per run; completions are polled with a short sleep (Mooncake's
    blocking wait spins a core, the one its TCP threads need on a small machine). A write not
    complete by `timeout_s` plus 100 MiB/s for its bytes is an error: the link or the decode
    instance is gone.
    """

    POLL_S = 50e-6

    def __init__(self, engine: MooncakeEngine, describe: dict, timeout_s: float = 5.0):
        self._engine = engine.engine
        self._target = describe["session"]
        self._dst_base = describe["address"]
        self.nbytes = describe["nbytes"]
        self._timeout_ns = int(timeout_s * 1e9)
        scratch = self._scratch = np.zeros(4096, np.uint8)
        engine.register(scratch.ctypes.data, scratch.nbytes)
        rc = self._engine.transfer_sync_read(
            self._target, scratch.ctypes.data, self._dst_base, scratch.nbytes
        )
        if rc != 0:  # connect now, not in the first layer
            raise ConnectorError(
                f"Mooncake could not reach the decode cache at {self._target} ({rc})"
            )

    def write(self, src_base: int, runs: list[Run]) -> None:
        ids, nbytes = [], 0
        for s, d, n in runs:
            batch = self._engine.transfer_submit_write(
                self._target, src_base + s, self._dst_base + d, n
            )
            if batch <= 0:
                raise ConnectorError(
                    f"Mooncake could not submit a write to {self._target} ({batch})"
                )
            ids.append(batch)
            nbytes += n
        deadline = time.monotonic_ns() + self._timeout_ns + nbytes * 10
        for batch in ids:
            while (status := self._engine.transfer_check_status(batch)) == 0:
                if time.monotonic_ns() > deadline:
                    raise ConnectorError(
                        f"a Mooncake write of {nbytes} bytes to {self._target} "
                        f"did not complete in time: the decode instance or "
                        f"the link is gone"
                    )
                time.sleep(self.POLL_S)
            if status != 1:
                raise ConnectorError(f"a Mooncake write to {self._target} failed ({status})")

    def close(self) -> None:
        pass


def coalesce(runs: list[Run]) -> list[Run]:
    """Merge runs that are consecutive on both sides."""
    out: list[list[int]] = []
    for s, d, n in runs:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(r) for r in out]
