"""The `mooncake` transport: one Mooncake transfer engine per process, P2PHANDSHAKE (no
metadata server). Its options (`transport("mooncake").configure(...)`, before first use):
  protocol   tcp (default) or rdma; else $PDHAL_MOONCAKE_PROTOCOL
  host       the address this process advertises (default 127.0.0.1); else
             $PDHAL_MOONCAKE_HOST
The endpoint registers its regions (over RDMA device memory by the address a NIC registers,
pdhal's get_peer_mem_addr; over TCP host memory only: MooncakeTransport.memory) and
describes its session and
their addresses; a link registers its sources and writes each run with
transfer_submit_write, checked with transfer_check_status. (One batch_transfer_async_write
per submit was tried: transfer_check_status reported such a batch done before all its
writes had landed, which the transport kit's every-byte test showed, 3 runs of 3.)
A batch's status is checked with sleeps of 50 us growing to 500 us:
Mooncake's blocking wait spins a core, the one its TCP threads need on a small machine.

Mooncake's RPC port listens on every interface whatever the host says: firewall it on a
shared network.

Completion is known at the target (MooncakeTransport.completion), on both protocols:
- TCP needs Mooncake's acknowledged framing ("protocol v2", Mooncake 0.3.12, #2086; its
  src/transport/tcp_transport/): the receiver sends a status frame once a WRITE's last
  chunk is in its memory, and the write completes on it. Before 0.3.12, with MC_TCP_PROTO=1
  (Mooncake's escape hatch: exactly "1" makes an initiator speak the legacy framing), or
  against a destination whose segment does not advertise tcp_proto_version >= 2, a write
  completes once its last chunk is in the local socket's buffer: a "landed" word written
  next overtook megabytes of data (507 of 609 requests, measured on 0.3.11). So the engine
  refuses a Mooncake before 0.3.12 and MC_TCP_PROTO=1 (when made and at each connect:
  Mooncake reads it at each transfer), an endpoint describes its Mooncake version and
  framing, and a link refuses a destination that does not describe the acknowledged one.
- RDMA: each write is an IBV_WR_RDMA_WRITE posted IBV_SEND_SIGNALED on a reliable-connected
  QP (src/transport/rdma_transport/rdma_endpoint.cpp), marked done on its work completion
  (worker_pool.cpp). On an RC QP that completion comes only after the responder's NIC
  acknowledged the data: it has it and has started placing it, ahead of a word submitted
  once the batch is done, which cannot reach that NIC before the acknowledgement. (Not
  proven here, no RDMA device: with PCIe relaxed ordering, which Mooncake requests for the
  memory it registers where the verbs library allows, MC_IB_PCI_RELAXED_ORDERING=0 turning
  it off, a later write to host memory may in principle pass an earlier one still on its
  way from the NIC.)"""

from __future__ import annotations

import os
import re
from importlib import metadata

import numpy as np

from pdhal import InvalidArgumentError, TransferError, ops
from pdhal.transfer import (
    BatchState,
    Endpoint,
    EngineTransport,
    LatchedLink,
    Option,
    PollingBatch,
    Registrations,
    RunChecker,
    described_numbers,
    one_of,
    region_bytes,
)

DONE, PENDING = 1, 0  # transfer_check_status
#: The protocols whose completion is known at the target (see above).
PROTOCOLS = ("tcp", "rdma")
#: The first Mooncake whose TCP writes complete at the target (acknowledged framing).
ACKNOWLEDGED = (0, 3, 12)
#: The TCP framing Mooncake's segments advertise from then on (tcp_proto_version).
TCP_FRAMING = 2
#: Mooncake's wheels (the one pip installed provides the `mooncake` package).
DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


def _installed() -> tuple[str, str]:
    """(distribution, version) of the Mooncake installed; ("", "") if pip does not know."""
    provides = metadata.packages_distributions().get("mooncake", [])
    names = [d for d in provides if d.startswith("mooncake-transfer-engine")]
    found = []
    for name in names or DISTRIBUTIONS:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append((_release(version), name, version))
    if not found:
        return "", ""
    _, name, version = min(found, key=lambda f: f[0] or ())  # two installed: the older rules
    return name, version


def _release(version: object) -> tuple[int, ...] | None:
    """The release of a version string ("0.3.12.post1" is 0.3.12; a pre-release or a dev
    build of 0.3.12 is before it: None, as for anything else that is not a release)."""
    if not isinstance(version, str):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(\.post\d+)?(\+[\w.]+)?", version)
    return tuple(int(n) for n in match.group(1).split(".")) if match else None


def acknowledged(version: object) -> bool:
    """Whether Mooncake `version` completes a TCP write only once the receiver has it."""
    release = _release(version)
    return release is not None and release >= ACKNOWLEDGED


def _refuse_legacy_framing(where: str) -> None:
    if os.environ.get("MC_TCP_PROTO") == "1":
        raise TransferError(
            f"MC_TCP_PROTO=1 is set {where}: it makes Mooncake speak its legacy TCP framing, "
            f"whose writes complete once in the local socket, so pdhal's 'landed' could "
            f"overtake the data; unset it (the acknowledged framing is Mooncake's default)"
        )


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

    def __init__(self, host: str, protocol: str):
        self.host, self.protocol = host, protocol
        self.distribution, self.version = _installed()
        if not acknowledged(self.version):
            least = ".".join(map(str, ACKNOWLEDGED))
            which = (
                f"Mooncake {self.version} ({self.distribution}) is installed"
                if self.version
                else f"pip knows no Mooncake here ({', '.join(DISTRIBUTIONS)}), so its version "
                f"cannot be checked"
            )
            raise TransferError(
                f"{which}: the mooncake transport needs Mooncake >= {least}, whose TCP writes "
                f"complete once the receiver has the bytes (before, once they are in the local "
                f"socket: 'landed' could overtake them); pip install -U "
                f"'{self.distribution or DISTRIBUTIONS[0]}>={least}'"
            )
        _refuse_legacy_framing("in this process's environment")
        self.engine = _engine_class()()
        rc = self.engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({self.host!r}, P2PHANDSHAKE, {self.protocol!r}) failed ({rc})"
            )
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self.registered = Registrations(self._register, self._unregister)

    def _register(self, address: int, nbytes: int) -> None:
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise TransferError(
                f"Mooncake could not register {nbytes} bytes at {address:#x} ({rc}: "
                f"overlapping memory registered by another user, or not registrable)"
            )

    def _unregister(self, address: int, _token: None) -> None:
        self.engine.unregister_memory(address)


class MooncakeBatch(PollingBatch):
    def __init__(self, link: MooncakeLink, ids: list[int], nbytes: int):
        super().__init__(link, nbytes)
        self._ids = ids

    def poll(self) -> tuple[BatchState, str]:
        status = self.link.status
        while self._ids:
            state = status(self._ids[0])
            if state == PENDING:
                return BatchState.IN_FLIGHT, ""
            if state != DONE:
                return BatchState.FAILED, f"{'timed out' if state == -2 else 'failed'} ({state})"
            self._ids.pop(0)
        return BatchState.LANDED, ""


class MooncakeLink(LatchedLink):
    def __init__(self, engine: _Engine, described: dict, sources: list[tuple[int, int]]):
        self._engine = engine
        if not isinstance(described, dict):
            raise InvalidArgumentError(f"a mooncake description is a dict, got {described!r}")
        self.target = described["session"]
        if not isinstance(self.target, str) or not re.fullmatch(r"\S+:\d+", self.target):
            raise InvalidArgumentError(
                f"the description's session must be 'host:port', got {self.target!r}"
            )
        self._runs = RunChecker(described["regions"], sources)
        self.regions = self._runs.regions
        self._addresses = described_numbers(described, "addresses", len(self.regions))
        self._require_framing(described)
        self._keys: list[int] = []
        try:
            for address, nbytes in sources:
                self._keys.append(engine.registered.add(address, nbytes))
            self._connect(described)
        except BaseException:
            self.close()
            raise

    def _require_framing(self, described: dict) -> None:
        """Refuse a destination whose writes would complete before its memory has them: one
        on another protocol, or over TCP on a Mooncake without the acknowledged framing
        (before 0.3.12, or a pdhal-mooncake that does not describe it)."""
        ours = self._engine
        _refuse_legacy_framing("here")  # Mooncake reads it at each transfer
        theirs, protocol = described.get("mooncake"), described.get("protocol")
        framing = described.get("tcp_proto_version")
        if protocol != ours.protocol:
            raise TransferError(
                f"the destination {self.target} uses Mooncake over {protocol!r}, this side "
                f"over {ours.protocol!r} (option protocol): set the same on both"
            )
        tcp_ok = protocol != "tcp" or (type(framing) is int and framing >= TCP_FRAMING)
        if not acknowledged(theirs) or not tcp_ok:
            said = (
                f"Mooncake {theirs} (TCP framing {framing!r})"
                if isinstance(theirs, str)
                else "a Mooncake it does not name (a pdhal-mooncake that predates the check)"
            )
            raise TransferError(
                f"the destination {self.target} runs {said}, this side Mooncake "
                f"{ours.version} (TCP framing {TCP_FRAMING}): a write to it could complete "
                f"before its memory has the bytes, so 'landed' could overtake them; upgrade "
                f"the destination's pdhal-mooncake and its Mooncake to >= "
                f"{'.'.join(map(str, ACKNOWLEDGED))}"
            )

    def _connect(self, described: dict) -> None:
        engine = self._engine
        self._submit = engine.engine.transfer_submit_write
        self.status = engine.engine.transfer_check_status
        self._scratch = np.zeros(64, np.uint8)  # connect now (a read), not in the first layer
        self._keys.append(engine.registered.add(self._scratch.ctypes.data, self._scratch.nbytes))
        rc = engine.engine.transfer_sync_read(
            self.target, self._scratch.ctypes.data, self._addresses[0], 8
        )
        if rc != 0:
            raise TransferError(f"Mooncake could not reach {self.target} ({rc})")

    def submit(self, runs) -> MooncakeBatch:
        self.refuse_if_failed()
        runs = self._runs.check(runs)  # every run, before the first is written
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
            self._engine.registered.release(self._keys.pop())


class MooncakeEndpoint(Endpoint):
    def __init__(self, engine: _Engine, regions: list, name: str):
        self._engine = engine
        self._sizes, self._addresses, self._keys = region_bytes(regions), [], []
        try:
            for region, nbytes in zip(regions, self._sizes):
                address = ops.get_peer_mem_addr(region)
                self._keys.append(engine.registered.add(address, nbytes))
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
            # what a link checks before writing here (the framing is the one a
            # Mooncake this recent advertises in its segment, which its writers follow)
            "mooncake": self._engine.version,
            "protocol": self._engine.protocol,
            "tcp_proto_version": TCP_FRAMING if self._engine.protocol == "tcp" else None,
        }

    def close(self) -> None:
        while self._keys:
            self._engine.registered.release(self._keys.pop())


class MooncakeTransport(EngineTransport):
    name = "mooncake"
    #: TCP with the acknowledged framing (required) or RDMA (RC writes): see above.
    completion = "target"
    options = {
        "protocol": Option(
            "tcp or rdma: a write completes at the target over both",
            "tcp",
            "PDHAL_MOONCAKE_PROTOCOL",
            one_of(*PROTOCOLS),
        ),
        "host": Option("the address this process advertises", "127.0.0.1", "PDHAL_MOONCAKE_HOST"),
    }

    @property
    def memory(self) -> tuple[str, ...] | None:
        """Over TCP, host memory only: Mooncake's TCP transport moves bytes with the CPU,
        which cannot read device memory (the streamer and the receiver stage device caches
        through pinned host memory). Over RDMA, any memory its NIC registers: device
        memory by the address get_peer_mem_addr gives (GPUDirect RDMA; not proven here, no
        RDMA device)."""
        return ("cpu",) if self.settings()["protocol"] == "tcp" else None

    def make_engine(self, settings: dict) -> _Engine:
        return _Engine(settings["host"], settings["protocol"])

    def endpoint(self, regions: list, name: str) -> Endpoint:
        return MooncakeEndpoint(self.engine(), regions, name)

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> MooncakeLink:
        try:
            return MooncakeLink(self.engine(), described, sources)
        except (KeyError, TypeError, AttributeError) as e:
            raise InvalidArgumentError(f"not a mooncake endpoint's description: {e}") from None
