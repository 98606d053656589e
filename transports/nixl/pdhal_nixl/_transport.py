"""The `nixl` transport: one NIXL agent per process with its UCX backend (RDMA where UCX
finds it; TCP or shared memory otherwise). The endpoint registers its regions (host memory)
and describes the agent's metadata (base64), their addresses and sizes; a link registers its
sources, loads the peer's metadata (one load per peer agent, shared by the links to it),
reads 8 bytes to connect at once, and writes each submit as one NIXL WRITE request. A
batch's state is checked with sleeps of 50 us growing to 500 us.

NIXL's own Python wrapper (nixl._api.nixl_agent) is not used: it starts the agent's
progress thread with a poll() timeout of 0, which spins a core for the process's life
(2.7 CPU-seconds in 3 idle seconds, measured). The agent is made from nixl._bindings with
a timeout of PDHAL_NIXL_PROGRESS_US (default 10000: the thread wakes on UCX's event fd
when data comes; the timeout is NIXL's workaround for a missed wake-up).

Its options (`transport("nixl").configure(...)`, before first use; each else from its
environment variable):
  ucx_tls          UCX_TLS for the agent (e.g. tcp; unset: UCX's choice); PDHAL_NIXL_UCX_TLS
  net_devices      UCX_NET_DEVICES (the interfaces UCX may use; unset: all);
                   PDHAL_NIXL_NET_DEVICES
  progress_us      the progress thread's longest sleep (default 10000); PDHAL_NIXL_PROGRESS_US
  connect_timeout  seconds the connecting read may take (default 10);
                   PDHAL_NIXL_CONNECT_TIMEOUT
  idle_peers       peers kept connected with no link to them (default 16);
                   PDHAL_NIXL_IDLE_PEERS
On a machine without RDMA devices (/sys/class/infiniband empty) UCX_MODULES defaults to
^ib: UCX's ib module, loaded and left idle, makes the process segfault at exit (in its
bundled libnl-route's destructor, rtnl_tc_unregister). UCX_LOG_FILE defaults to stderr
and NIXL's Python logger (INFO lines) is sent to stderr at WARNING (NIXL_LOG_LEVEL, when
set, rules): both write to stdout otherwise, which is many programs' protocol.

A batch that outlives its wait's timeout is failed for the caller, but its request stays
with the link until UCX ends it: UCX cannot take back a write it started, so cancelling
it would only free what UCX may still read. Writes to the same bytes from a later submit
could be overtaken by such a stalled one if it lands after all, as with any transport
whose writes are in the network when the caller gives up."""

from __future__ import annotations

import base64
import logging
import os
import socket
import sys
import threading
import time
import uuid

import numpy as np

from pdhal import InvalidArgumentError, TransferError, ops
from pdhal.transfer import (
    BatchState,
    Endpoint,
    EngineTransport,
    LandedBatch,
    LatchedLink,
    Option,
    PollingBatch,
    Registrations,
    RunChecker,
    described_numbers,
    nap_until,
    positive,
    region_bytes,
    region_devices,
)


def _bindings():
    """NIXL's C++ bindings: through the `nixl` meta package, else the build installed."""
    try:
        from nixl import _bindings
    except ImportError:
        import importlib

        for name in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
            try:
                return importlib.import_module(f"{name}._bindings")
            except ImportError:
                continue
        raise
    return _bindings


def _quiet_python_logger() -> None:
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    logger = logging.getLogger("nixl")
    logger.handlers[:] = [logging.StreamHandler(sys.stderr)]
    logger.setLevel(logging.WARNING)


def _configure_ucx(settings: dict) -> None:
    """UCX reads its settings from the environment, when the agent starts."""
    for key, theirs in (("ucx_tls", "UCX_TLS"), ("net_devices", "UCX_NET_DEVICES")):
        if settings[key]:
            os.environ[theirs] = settings[key]
    try:
        rdma = os.listdir("/sys/class/infiniband")
    except OSError:
        rdma = []
    if not rdma:
        os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("UCX_LOG_FILE", "stderr")  # UCX logs to stdout by default


def _text(name) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


class _Agent:
    """The process's NIXL agent, what it has registered, and the peers it has loaded."""

    def __init__(self, settings: dict):
        _configure_ucx(settings)
        self.connect_timeout = settings["connect_timeout"]
        nixl = self.nixl = _bindings()
        _quiet_python_logger()
        config = nixl.nixlAgentConfig()
        config.useProgThread = True  # the destination's UCX must progress to receive (TCP)
        config.useListenThread = False  # metadata travels in describe(), not by socket
        config.syncMode = nixl.NIXL_THREAD_SYNC_RW
        config.pthrDelay = settings["progress_us"]
        config.captureTelemetry = False
        self.name = f"pdhal-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl.nixlAgent(self.name, config)
        if "UCX" not in self.agent.getAvailPlugins():
            raise TransferError(
                f"NIXL has no UCX plugin here (it has {', '.join(self.agent.getAvailPlugins())})"
            )
        try:
            self.backend = self.agent.createBackend("UCX", {})
        except Exception as e:
            raise TransferError(f"NIXL could not start its UCX backend: {_why(e)}") from None
        self.backends = [self.backend]
        self.dram = nixl.DRAM_SEG
        self.registered = Registrations(self._register, self._unregister)
        # peer agent -> [the name NIXL gave it, links, its metadata, seen failing]
        self._peers: dict[str, list] = {}
        self._idle: dict[str, None] = {}  # the peers no link uses, the longest idle first
        self._parked: list[tuple[int, str]] = []  # (request, peer) of closed links
        self.idle_peers = settings["idle_peers"]
        self._lock = threading.Lock()

    def _register(self, address: int, nbytes: int):
        """Register [address, +nbytes) of host memory; its descriptor list."""
        descs = self.nixl.nixlRegDList(self.dram, [(address, nbytes, 0, "")])
        try:
            self.agent.registerMem(descs, self.backends)
        except Exception as e:
            raise TransferError(
                f"NIXL could not register {nbytes} bytes at {address:#x}: {_why(e)}"
            ) from None
        return descs

    def _unregister(self, _address: int, descs) -> None:
        self.agent.deregisterMem(descs, self.backends)

    def metadata(self) -> bytes:
        with self._lock:
            return self.agent.getLocalMD()

    def load(self, peer: str, metadata: bytes):
        """Load a peer agent's metadata (again if it changed: it may describe more regions
        now); returns the name to address it by. forget() it once per load."""
        with self._lock:
            entry = self._peers.get(peer)
            if entry is None or entry[2] != metadata:
                try:
                    name = self.agent.loadRemoteMD(metadata)
                except Exception as e:
                    raise TransferError(
                        f"NIXL could not load {peer}'s metadata: {_why(e)}"
                    ) from None
                if _text(name) != peer:
                    if entry is None and _text(name) not in self._peers:
                        self.agent.invalidateRemoteMD(name)
                    raise TransferError(f"the metadata described as {peer}'s is {_text(name)}'s")
                if entry is None:
                    entry = self._peers[peer] = [name, 0, metadata, False]
                entry[2] = metadata
            entry[1] += 1
            self._idle.pop(peer, None)
            return entry[0]

    def park(self, handles: list[int], peer: str) -> None:
        """Requests a closed link left in flight to `peer`: released once UCX ended them
        or the peer is disconnected (before, NIXL's release would cancel them, which UCX
        cannot do for a write it started, and free what it may still read)."""
        with self._lock:
            self._parked.extend((handle, peer) for handle in handles)
            parked, self._parked = self._parked, []
        for handle, to in parked:
            try:
                status = self.agent.getXferStatus(handle)
            except Exception:
                status = None  # failed: ended
            if status == self.nixl.NIXL_IN_PROG and to in self._peers:
                with self._lock:
                    self._parked.append((handle, to))
                continue
            try:
                self.agent.releaseXferReq(handle)
            except Exception:  # NIXL keeps it: never freed under UCX, at worst a leak
                pass

    def forget(self, peer: str, broken: bool) -> None:
        """One link less to `peer` (`broken`: it saw the peer fail). A peer no link uses
        stays loaded, connected, for the next link to it, unless it failed or
        idle_peers others are idle already: NIXL's invalidateRemoteMD leaves
        this process's sockets to the peer open (2 on a host with 2 interfaces) until
        the peer's process exits, so a peer dropped and linked again costs them again."""
        with self._lock:
            entry = self._peers.get(peer)
            if entry is None:
                return
            entry[1] -= 1
            entry[3] = entry[3] or broken
            if entry[1] > 0:
                return
            if not entry[3]:
                self._idle[peer] = None
                if len(self._idle) <= self.idle_peers:
                    return
                peer = next(iter(self._idle))  # the one idle longest
            self._idle.pop(peer, None)
            name = self._peers.pop(peer)[0]
            try:
                self.agent.invalidateRemoteMD(name)
            except Exception:  # a dead peer's metadata may be dropped already
                pass


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class NixlBatch(PollingBatch):
    def __init__(self, link: NixlLink, handle: int, nbytes: int):
        super().__init__(link, nbytes)
        self._handle = handle

    def poll(self) -> tuple[BatchState, str]:
        state, why = self.link.state(self._handle)
        if state is None:
            return BatchState.IN_FLIGHT, ""
        self.link.release(self._handle)
        return (BatchState.LANDED, "") if state else (BatchState.FAILED, f"failed ({why})")

    def abandon(self) -> None:
        self.link.orphan(self._handle)  # UCX cannot take a started write back: see above


class NixlLink(LatchedLink):
    _peer = None

    def __init__(self, agent: _Agent, described: dict, sources: list[tuple[int, int]]):
        self._agent = agent
        self.target = str(described["agent"])
        self._runs = RunChecker(described["regions"], sources)  # sizes checked, and sources
        self.regions = self._runs.regions
        self._addresses = described_numbers(described, "addresses")
        metadata = base64.b64decode(described["metadata"], validate=True)
        if len(self._addresses) != len(self.regions) or not self.regions:
            raise InvalidArgumentError(
                f"a nixl endpoint's description has {len(self._addresses)} addresses for "
                f"{len(self.regions)} regions"
            )
        self._keys: list[int] = []
        self._orphans: list[int] = []  # requests given up by a wait, not yet ended by UCX
        self._lock = threading.Lock()
        nixl = agent.nixl
        self._write, self._dram = nixl.NIXL_WRITE, nixl.DRAM_SEG
        self._in_progress, self._success = nixl.NIXL_IN_PROG, nixl.NIXL_SUCCESS
        self._xfer_list = nixl.nixlXferDList
        try:
            for address, nbytes in sources:
                self._keys.append(agent.registered.add(int(address), int(nbytes)))
            self._peer = agent.load(self.target, metadata)
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        """Read the destination's first 8 bytes: connected now, not in the first layer,
        and a peer that cannot be reached is reported here."""
        scratch = np.zeros(8, np.uint8)
        self._keys.append(self._agent.registered.add(scratch.ctypes.data, scratch.nbytes))
        size = min(8, self.regions[0])
        handle = self._request(
            self._agent.nixl.NIXL_READ,
            [(scratch.ctypes.data, size, 0)],
            [(self._addresses[0], size, 0)],
        )
        bound = self._agent.connect_timeout
        ended: list[tuple[bool | None, str]] = []

        def answered() -> bool:
            ended.append(self.state(handle))
            return ended[-1][0] is not None

        if not nap_until(answered, time.monotonic() + bound):
            self.orphan(handle)
            raise TransferError(
                f"NIXL could not reach {self.target} within {bound:g} s (option connect_timeout)"
            )
        self.release(handle)
        if not ended[-1][0]:
            raise TransferError(f"NIXL could not reach {self.target} ({ended[-1][1]})")

    def _request(self, operation, local: list, remote: list) -> int:
        """Create and post one request; TransferError (the link latched broken) if NIXL
        refuses either. Returns its handle, in flight or done."""
        agent = self._agent.agent
        try:
            handle = agent.createXferReq(
                operation,
                self._xfer_list(self._dram, np.array(local, np.uint64)),
                self._xfer_list(self._dram, np.array(remote, np.uint64)),
                self._peer,
                b"",
                self._agent.backends,
            )
        except Exception as e:
            raise TransferError(
                self.failed(f"NIXL could not make a request to {self.target}: {_why(e)}")
            ) from None
        try:
            status = agent.postXferReq(handle, b"")
        except Exception as e:
            status = e
        if status not in (self._success, self._in_progress):
            self.release(handle)
            why = _why(status) if isinstance(status, Exception) else f"status {status}"
            raise TransferError(self.failed(f"NIXL could not post a write to {self.target}: {why}"))
        return handle

    def state(self, handle: int) -> tuple[bool | None, str]:
        """(None, "") while `handle` is in flight; (True, "") once done; (False, why)."""
        try:
            status = self._agent.agent.getXferStatus(handle)
        except Exception as e:
            return False, _why(e)
        if status == self._in_progress:
            return None, ""
        if status == self._success:
            return True, ""
        return False, f"status {status}"

    def release(self, handle: int) -> None:
        try:
            self._agent.agent.releaseXferReq(handle)
        except Exception:  # still active (UCX cannot cancel it): kept until it ends
            with self._lock:
                self._orphans.append(handle)

    def orphan(self, handle: int) -> None:
        with self._lock:
            self._orphans.append(handle)

    def _reap(self) -> None:
        """Release the orphans UCX has ended since."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        for handle in orphans:
            if self.state(handle)[0] is None:
                self.orphan(handle)
            else:
                self.release(handle)

    def submit(self, runs) -> PollingBatch | LandedBatch:
        self.refuse_if_failed()
        runs = self._runs.check(runs)  # every run, before the first is written
        if self._orphans:
            self._reap()
        if not runs:
            return LandedBatch()
        addresses = self._addresses
        local = [(src, nbytes, 0) for src, _, _, nbytes in runs]
        remote = [(addresses[region] + offset, nbytes, 0) for _, region, offset, nbytes in runs]
        handle = self._request(self._write, local, remote)
        return NixlBatch(self, handle, sum(n for _, _, _, n in runs))

    def close(self) -> None:
        """Let the peer go (it stays connected for the next link to it unless it failed,
        or a request to it is still in flight: then it is disconnected first, UCX
        dropping what it had not sent), then release the requests and registrations."""
        self._reap()
        peer, self._peer = self._peer, None
        if peer is not None:
            stuck = bool(self._orphans) or self.problem() is not None
            self._agent.forget(self.target, broken=stuck)
        with self._lock:
            orphans, self._orphans = self._orphans, []
        self._agent.park(orphans, self.target)
        while self._keys:
            self._agent.registered.release(self._keys.pop())


class NixlEndpoint(Endpoint):
    def __init__(self, agent: _Agent, regions: list, name: str):
        self._agent = agent
        self._sizes, self._addresses, self._keys = region_bytes(regions), [], []
        try:
            devices = region_devices(regions)
            for index, (region, nbytes) in enumerate(zip(regions, self._sizes)):
                device = devices[index]
                if device not in ("cpu", "unknown"):
                    raise InvalidArgumentError(
                        f"region {index} is {device} memory: the nixl transport serves host "
                        f"memory (DRAM) only"
                    )
                address = ops.get_peer_mem_addr(region)
                self._keys.append(agent.registered.add(address, nbytes))
                self._addresses.append(address)
            self._metadata = base64.b64encode(agent.metadata()).decode()
        except BaseException:
            self.close()
            raise
        self._name = name

    def describe(self) -> dict:
        return {
            "transport": NixlTransport.name,
            "agent": self._agent.name,
            "metadata": self._metadata,
            "addresses": list(self._addresses),
            "regions": list(self._sizes),
            "name": self._name,
        }

    def close(self) -> None:
        while self._keys:
            self._agent.registered.release(self._keys.pop())


class NixlTransport(EngineTransport):
    name = "nixl"
    #: NIXL's UCX backend follows each request's writes with ucp_ep_flush_nbx and keeps the
    #: request in progress until the flush completes (src/plugins/ucx/ucx_backend.cpp,
    #: sendXferRange; ucx_utils.cpp, flushEp): UCX completes a flush once every put before
    #: it completed at the remote side, over any of its transports (tcp acknowledges puts).
    completion = "target"
    options = {
        "ucx_tls": Option("UCX_TLS for the agent (e.g. tcp)", None, "PDHAL_NIXL_UCX_TLS"),
        "net_devices": Option("UCX_NET_DEVICES for the agent", None, "PDHAL_NIXL_NET_DEVICES"),
        "progress_us": Option(
            "the progress thread's longest sleep (us)",
            10000,
            "PDHAL_NIXL_PROGRESS_US",
            positive(int),
        ),
        "connect_timeout": Option(
            "seconds a link's connecting read may take",
            10.0,
            "PDHAL_NIXL_CONNECT_TIMEOUT",
            positive(float),
        ),
        "idle_peers": Option(
            "peers kept connected with no link to them", 16, "PDHAL_NIXL_IDLE_PEERS", positive(int)
        ),
    }

    def make_engine(self, settings: dict) -> _Agent:
        return _Agent(settings)

    def endpoint(self, regions: list, name: str) -> Endpoint:
        return NixlEndpoint(self.engine(), regions, name)

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> NixlLink:
        try:
            return NixlLink(self.engine(), described, sources)
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"not a nixl endpoint's description: {e}") from None
