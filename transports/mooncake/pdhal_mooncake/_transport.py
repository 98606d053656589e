"""The `mooncake` transport: one Mooncake transfer engine per process, P2PHANDSHAKE (no
metadata server), RDMA or TCP (PDHAL_MOONCAKE_PROTOCOL, default tcp) on the address
PDHAL_MOONCAKE_HOST (default 127.0.0.1). The endpoint registers its regions (device memory
by the address a NIC registers, pdhal's get_peer_mem_addr) and describes its session and
their addresses; a link registers its sources and writes each run with
transfer_submit_write, checked with transfer_check_status. (One batch_transfer_async_write
per submit was tried: transfer_check_status reported such a batch done before all its
writes had landed, which the transport kit's every-byte test showed, 3 runs of 3.)
A batch's status is checked with sleeps of 50 us growing to 500 us:
Mooncake's blocking wait spins a core, the one its TCP threads need on a small machine.

Mooncake's RPC port listens on every interface whatever the host says: firewall it on a
shared network."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from pdhal import InvalidArgumentError, TransferError, ops
from pdhal.transfer import Batch, Endpoint, Link, RunChecker, Transport, region_bytes

POLL_S = (50e-6, 500e-6)  # the first sleep between status checks, and the longest
DONE, PENDING = 1, 0  # transfer_check_status


def _engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise TransferError(
                "Mooncake is installed but cannot load libibverbs.so.1: install libibverbs1"
            ) from None
        raise
    return TransferEngine


class _Engine:
    """The process's transfer engine, and what it has registered."""

    def __init__(self):
        self.host = os.environ.get("PDHAL_MOONCAKE_HOST", "127.0.0.1")
        self.protocol = os.environ.get("PDHAL_MOONCAKE_PROTOCOL", "tcp")
        self.engine = _engine_class()()
        rc = self.engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({self.host!r}, P2PHANDSHAKE, {self.protocol!r}) failed ({rc})"
            )
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self._registered: dict[int, list[int]] = {}  # start -> [bytes, users]
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> int:
        """Register [address, +nbytes) (a range inside one registered already counts as
        another user of that one); returns the key to release() it with."""
        with self._lock:
            for start, entry in self._registered.items():
                if start <= address and address + nbytes <= start + entry[0]:
                    entry[1] += 1
                    return start
            rc = self.engine.register_memory(address, nbytes)
            if rc != 0:
                raise TransferError(
                    f"Mooncake could not register {nbytes} bytes at {address:#x} ({rc}: "
                    f"overlapping memory registered by another user, or not registrable)"
                )
            self._registered[address] = [nbytes, 1]
            return address

    def release(self, key: int) -> None:
        """One user less of the registration `key`; unregistered with its last."""
        with self._lock:
            entry = self._registered.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._registered[key]
                    self.engine.unregister_memory(key)


class MooncakeBatch(Batch):
    def __init__(self, link: MooncakeLink, ids: list[int], nbytes: int):
        self._link, self._ids, self.nbytes = link, ids, nbytes
        self._failed: str | None = None

    def done(self) -> bool:
        if self._failed:
            raise TransferError(self._failed)
        status = self._link.status
        while self._ids:
            state = status(self._ids[0])
            if state == PENDING:
                return False
            if state != DONE:
                self._failed = self._link.failed(
                    f"a write of {self.nbytes} bytes to {self._link.target} "
                    f"{'timed out' if state == -2 else 'failed'} ({state})"
                )
                raise TransferError(self._failed)
            self._ids.pop(0)
        return True

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        nap, longest = POLL_S
        while not self.done():
            if time.monotonic() > deadline:  # a stall may pass: the link stays usable
                self._failed = (
                    f"a write of {self.nbytes} bytes to {self._link.target} did not land "
                    f"within {timeout:.3g} s: the link or the destination is gone or stalled"
                )
                raise TransferError(self._failed)
            time.sleep(nap)
            nap = min(2 * nap, longest)


class MooncakeLink(Link):
    _broken: str | None = None

    def __init__(self, engine: _Engine, described: dict, sources: list[tuple[int, int]]):
        self._engine = engine
        self.target = described["session"]
        self._addresses = list(described["addresses"])
        self.regions = list(described["regions"])
        self._runs = RunChecker(self.regions, sources)
        self._keys: list[int] = []
        try:
            for address, nbytes in sources:
                self._keys.append(engine.register(address, nbytes))
            self._connect(described)
        except BaseException:
            self.close()
            raise

    def _connect(self, described: dict) -> None:
        engine = self._engine
        self._submit = engine.engine.transfer_submit_write
        self.status = engine.engine.transfer_check_status
        self._scratch = np.zeros(64, np.uint8)  # connect now (a read), not in the first layer
        self._keys.append(engine.register(self._scratch.ctypes.data, self._scratch.nbytes))
        rc = engine.engine.transfer_sync_read(
            self.target, self._scratch.ctypes.data, self._addresses[0], 8
        )
        if rc != 0:
            raise TransferError(f"Mooncake could not reach {self.target} ({rc})")

    def failed(self, why: str) -> str:
        """Note a failure Mooncake reported: the link reports it (problem()) from now on."""
        self._broken = why
        return why

    def problem(self) -> str | None:
        return self._broken

    def submit(self, runs) -> Batch:
        if self._broken:
            raise TransferError(self._broken)
        self._runs.check(runs)  # every run, before the first is written
        ids, total = [], 0
        for src, region, offset, nbytes in runs:
            batch = self._submit(self.target, src, self._addresses[region] + offset, nbytes)
            if batch <= 0:
                raise TransferError(
                    self.failed(f"Mooncake could not submit a write to {self.target} ({batch})")
                )
            ids.append(batch)
            total += nbytes
        return MooncakeBatch(self, ids, total)

    def close(self) -> None:
        while self._keys:
            self._engine.release(self._keys.pop())


class MooncakeEndpoint(Endpoint):
    def __init__(self, engine: _Engine, regions: list, name: str):
        self._engine = engine
        self._sizes, self._addresses, self._keys = region_bytes(regions), [], []
        try:
            for region, nbytes in zip(regions, self._sizes):
                address = ops.get_peer_mem_addr(region)
                self._keys.append(engine.register(address, nbytes))
                self._addresses.append(address)
        except BaseException:
            self.close()
            raise
        self._name = name

    def describe(self) -> dict:
        return {
            "transport": MooncakeTransport.name,
            "session": self._engine.session,
            "addresses": list(self._addresses),
            "regions": list(self._sizes),
            "name": self._name,
        }

    def close(self) -> None:
        while self._keys:
            self._engine.release(self._keys.pop())


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self):
        self._engine: _Engine | None = None
        self._lock = threading.Lock()

    def _the_engine(self) -> _Engine:
        with self._lock:
            if self._engine is None:
                self._engine = _Engine()
            return self._engine

    def endpoint(self, regions: list, name: str) -> Endpoint:
        return MooncakeEndpoint(self._the_engine(), regions, name)

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> Link:
        try:
            return MooncakeLink(self._the_engine(), described, sources)
        except KeyError as e:
            raise InvalidArgumentError(f"not a mooncake endpoint's description: {e}") from None
