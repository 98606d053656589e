"""The `shm` transport (built in): both sides on one host. The endpoint publishes each
region through pdhal's shared memory (set_data_ipc); a link maps them (get_data_ptr_ipc)
and hands its copies to a C thread of its own (copier.c), which memmoves them in order
without the GIL: a submit checks every run and returns once they are queued, and its batch
is done once they are in the destination's memory. A peer is alive while its
process is: the endpoint's pid and start time are in its description (a recycled pid is
another process). So is its namespace: a link maps only within its own (as a session
refuses a peer of another), and a description from another namespace is refused naming both.

An endpoint name is unique on the host: a name a live endpoint serves, in this process or
another, is refused (ChannelBusyError naming it). A link checks its peer's description (its
types, and each region's size against what the name really maps to) before the first byte
moves, and unmaps the peer's regions when the last link to them in this process closes."""

from __future__ import annotations

import errno
import os
import select
import threading
from collections.abc import Callable

from pdhal import ops
from pdhal._errors import (
    ChannelBusyError,
    ClosedHandleError,
    InvalidArgumentError,
    PdhalError,
    TransferError,
)
from pdhal._memory import extents as _extents
from pdhal._memory import mappings as _mappings
from pdhal._memory import published
from pdhal._protocol import core as _core
from pdhal._protocol.names import buffer_path, namespace, validate_name
from pdhal._transfer import checks
from pdhal._transfer.contract import (
    Batch,
    Endpoint,
    Gate,
    Link,
    Run,
    RunChecker,
    Transport,
    region_bytes,
    require_blocks,
)
from pdhal._transfer.kit import LandedBatch
from pdhal._transfer.layout import BlockRuns, LayerCopies, PieceCopies, UnitCopies
from pdhal._version import __version__


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


#: The (namespace, name) of each endpoint this process serves. set_data_ipc refuses a name
#: another live process publishes, but replaces this process's own record: without this, a
#: second endpoint of one name would take the first one's regions from under it.
_serving: set[tuple[str, str]] = set()
#: How many of this process's links map each (namespace, published name): the last to close
#: unmaps it (a reconnection opens its new link before the old one closes).
_mapped: dict[tuple[str, str], int] = {}
_lock = threading.Lock()


def _map(name: str, timeout: float) -> int:
    """The address of the region published as `name`, mapped for one more link."""
    key = (namespace(), name)
    with _lock:
        _mapped[key] = _mapped.get(key, 0) + 1
    try:
        return ops.get_data_ptr_ipc(None, name, timeout)
    except BaseException:
        _unmap(name)
        raise


def _unmap(name: str) -> None:
    """One link less maps `name`; the last one unmaps it (under the lock, so that a link
    mapping it meanwhile maps it afresh)."""
    key = (namespace(), name)
    with _lock:
        left = _mapped.pop(key) - 1
        if left:
            _mapped[key] = left
        else:
            ops.unset_data_ipc(None, name, True, False)


class ShmEndpoint(Endpoint):
    """Each region published as NAME.r<i> in pdhal's shared memory."""

    def __init__(self, regions: list, name: str):
        validate_name(name, "name")
        self._sizes = region_bytes(regions)
        self._names: list[str] = []
        self._key = None
        self._namespace = namespace()
        key = (self._namespace, name)
        with _lock:
            if key in _serving:
                raise ChannelBusyError(
                    errno.EBUSY,
                    f"the endpoint name {name!r} is served already by this process (pid "
                    f"{os.getpid()}): close that endpoint first, or pick another name",
                )
            _serving.add(key)
        self._key = key
        try:
            for index, region in enumerate(regions):
                shared = f"{name}.r{index}"
                try:
                    ops.set_data_ipc(region, shared)
                except ChannelBusyError as e:
                    raise ChannelBusyError(
                        errno.EBUSY,
                        f"the endpoint name {name!r} is served already by another live "
                        f"process on this host ({e}): pick another name",
                    ) from None
                self._names.append(shared)
        except BaseException:
            self.close()
            raise
        self._pid = os.getpid()

    def describe(self) -> dict:
        return {
            "transport": ShmTransport.name,
            "namespace": self._namespace,
            "names": list(self._names),
            "regions": list(self._sizes),
            "pid": self._pid,
            "started": _start_time(self._pid),
        }

    def close(self) -> None:
        try:
            while self._names:
                name = self._names.pop()
                try:
                    ops.unset_data_ipc(None, name, False, True)
                except InvalidArgumentError:  # unpublished by hand already: gone either way
                    pass
        finally:  # a name unset by hand meanwhile must not keep the endpoint's name taken
            with _lock:
                if self._key is not None:
                    _serving.discard(self._key)
                    self._key = None


def _checked(described: object, transport: str) -> tuple[int, str, list[str], list[int]]:
    """(pid, start time, names, region sizes) of a peer's description for a link of
    `transport` ("shm", "ipc"): InvalidArgumentError naming what is wrong with it (a peer's
    word is checked like a caller's)."""
    if not isinstance(described, dict):
        raise InvalidArgumentError(f"an {transport} description must be a dict, got {described!r}")
    fields = ("transport", "namespace", "pid", "started", "names", "regions")
    missing = [key for key in fields if key not in described]
    if missing:
        raise InvalidArgumentError(f"the {transport} description lacks {', '.join(missing)}")
    if described["transport"] != transport:
        raise InvalidArgumentError(
            f"the description is of transport {described['transport']!r}, not {transport!r}: "
            f"connect it with transport {described['transport']!r}"
        )
    theirs, ours = described["namespace"], namespace()
    if theirs != ours:
        raise InvalidArgumentError(
            f"the destination serves in namespace {theirs!r}, this process in {ours!r} "
            f"(PDHAL_NAMESPACE): shm maps a peer's memory within one namespace, which keeps "
            f"deployments apart; give both sides the same PDHAL_NAMESPACE"
        )
    # a pid is at most PID_MAX_LIMIT (2^22) on Linux
    pid = checks.integer(described["pid"], "the description's pid", 1, 1 << 22)
    started = described["started"]
    if not isinstance(started, str) or not started.isdigit():
        raise InvalidArgumentError(
            f"the description's started must be a process start time (a str of digits), "
            f"got {started!r}"
        )
    names, sizes = described["names"], described["regions"]
    for what, value in (("names", names), ("regions", sizes)):
        if not isinstance(value, list):
            raise InvalidArgumentError(f"the description's {what} must be a list, got {value!r}")
    if len(names) != len(sizes):
        raise InvalidArgumentError(
            f"the description names {len(names)} regions but sizes {len(sizes)}"
        )
    for index, name in enumerate(names):
        validate_name(name, f"the description's names[{index}]")
    sizes = [
        checks.integer(size, f"the description's regions[{index}] (its bytes)")
        for index, size in enumerate(sizes)
    ]
    return pid, started, list(names), sizes


def _poster(layer: LayerCopies, runs: BlockRuns) -> Callable[[_core.Copier], _core.CopyJob]:
    """What posts the copies of block `runs` in `layer` to a copier: blocks, the units of
    two block sizes, or pieces converted between two orders."""
    if isinstance(layer, PieceCopies):  # (a UnitCopies of one-token units, and orders)
        return lambda copier: copier.post_pieces(
            layer.caches, layer.heads, layer.orders, layer.count, layer.units,
            runs.words, len(runs),
        )  # fmt: skip
    if isinstance(layer, UnitCopies):
        return lambda copier: copier.post_units(
            layer.caches, layer.heads, layer.count, layer.units, runs.words, len(runs)
        )
    return lambda copier: copier.post_blocks(layer.caches, layer.count, runs.words, len(runs))


class _ShmBatch(Batch):
    """One submit's copies, queued on the link's copier (behind their gate's job, if
    gated: it fails them if it fails)."""

    __slots__ = ("_job", "_gate")

    def __init__(self, job: _core.CopyJob, gate: _core.CopyJob | None = None):
        self._job, self._gate = job, gate

    def done(self) -> bool:
        if not self._job.done():
            return False
        self._job.wait(0)  # raises the reason if it failed
        return True

    def wait(self, timeout: float) -> None:
        self._job.wait(timeout)

    def started_ns(self) -> int:
        """When its copies started (gated: when the link saw the signal); 0 until then."""
        return self._job.started_ns()

    def cancel(self) -> None:
        if self._gate is not None:
            self._gate.cancel()


class ShmLink(Link):
    """The endpoint's regions mapped here, copied into by a copier thread (a submit
    queues). The destination's exit is watched through a pidfd (opened once, then checked
    to be the described process by its start time), or through /proc where pidfds are
    missing."""

    #: The transport whose descriptions it takes.
    transport = "shm"
    #: Whether a region may map to device memory (the copier's memmove reaches host memory
    #: only: a description of device memory is refused).
    maps_device_memory = False

    def __init__(self, described: dict, sources: list[tuple[int, int]], timeout: float):
        self._pid, self._started, names, sizes = _checked(described, self.transport)
        self._records: list[str] = []  # the first and last region's record files
        self._runs = RunChecker(sizes, sources)
        spans = self._read_here(self._runs.spans())
        unread = _mappings.unreadable(spans)
        if unread is not None:
            address, nbytes = spans[unread]
            raise InvalidArgumentError(
                f"source [{address:#x}, +{nbytes}) is not memory this process can read: a "
                f"link copies from the memory it is given, which must be mapped here"
            )
        self.regions = sizes
        self._names: list[str] = []
        # each region's address and extent (held while copying into it), as one value: a
        # close swaps it whole, so a submit reads both of one mapping
        self._targets: tuple[list[int], list[_extents.Extent]] = ([], [])
        self._copier: _core.Copier | None = None
        #: A second copier, for gated submits only (made by the first): a gate waiting for
        #: its signal holds up no other submit
        self._gated: _core.Copier | None = None
        self._lock = threading.Lock()  # a post against close
        # the pdhal memory its copies touch (the regions mapped, the sources pdhal knows),
        # marked with the copier: a free of any of it here waits for the copies queued
        self._touched: list[_extents.Extent] = []
        self._pidfd, self._exit, self._exit_lock = -1, None, threading.Lock()
        try:
            self._pidfd = os.pidfd_open(self._pid)
        except (AttributeError, OSError):  # no pidfds here, or gone already (/proc says)
            pass
        else:
            self._exit = select.poll()
            self._exit.register(self._pidfd, select.POLLIN)
        try:
            if _start_time(self._pid) != self._started:
                raise TransferError(f"the destination process (pid {self._pid}) is gone")
            for index, name in enumerate(names):
                base = _map(name, timeout)
                self._names.append(name)
                # the runs are bounded by the described sizes: each must be what the name
                # really maps to, or a lying peer would have this process copy past it
                extent = _extents.find(base)
                real = extent.nbytes if extent is not None and extent.start == base else None
                if real != sizes[index]:
                    raise InvalidArgumentError(
                        f"the description's region {index} ({name!r}) is {sizes[index]} bytes, "
                        f"but what it maps to is "
                        f"{'of unknown size' if real is None else f'{real} bytes'}"
                    )
                if extent.device != "cpu" and not self.maps_device_memory:
                    raise InvalidArgumentError(
                        f"the description's region {index} ({name!r}) is {extent.device} "
                        f"memory; the {self.transport} transport moves host memory only"
                    )
                # ... and published by the described process, whose life is watched
                publisher = published.publisher(name)
                if publisher != self._pid:
                    raise InvalidArgumentError(
                        f"the description's region {index} ({name!r}) is published by pid "
                        f"{publisher}, not by the described pid {self._pid}"
                    )
                self._targets[0].append(base)
                self._targets[1].append(extent)
            if names:
                self._records = [buffer_path(names[0]), buffer_path(names[-1])]
            self.region_kinds = [extent.device.split(":")[0] for extent in self._targets[1]]
            spans = self._runs.spans()
            self._copier = _core.Copier(self._targets[0], sizes, spans)
            self._sizes, self._spans = sizes, spans
            sources = [_extents.find(address) for address, _ in spans]
            self._touched = [e for e in [*self._targets[1], *sources] if e is not None]
            _extents.mark_queued(self._touched, self._copier)
        except BaseException:
            self.close()
            raise

    def _read_here(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The source spans this process's own loads read (all of shm's: its copier
        memmoves from host memory), which must be mapped readable here."""
        return spans

    def problem(self) -> str | None:
        with self._exit_lock:  # a poll object refuses two threads at once
            if self._exit is not None:
                gone = bool(self._exit.poll(0))  # readable once the process exited
            else:
                gone = _start_time(self._pid) != self._started
        if gone:
            return f"the destination process (pid {self._pid}) is gone"
        if self._records and not all(os.path.exists(path) for path in self._records):
            # its endpoint closed (the receiver too): what it served may be reused there
            return f"the destination (pid {self._pid}) closed its endpoint"
        return None

    def submit(self, runs: list[Run]) -> Batch:
        why = self.problem()
        if why is not None:
            raise TransferError(why)
        runs = self._runs.check(runs)  # every field, named; the copier checks the bounds too
        if not runs:
            return LandedBatch()
        return self._post(lambda copier: copier.post_runs(runs))

    def submit_blocks(self, layer: LayerCopies, runs: BlockRuns, gate: Gate | None = None) -> Batch:
        """The copier expands and checks the block runs in C (the unit runs of two block
        sizes too): no Python per run. A gate is a job of the copier's before them, its
        thread waiting on the signal's futex."""
        require_blocks(layer, runs)
        if gate is not None and not isinstance(gate, Gate):
            raise InvalidArgumentError(f"gate must be a Gate, got {gate!r}")
        why = self.problem()
        if why is not None:
            raise TransferError(why)
        if not len(runs):
            return LandedBatch()
        return self._post(_poster(layer, runs), gate)  # whichever copies: behind the gate

    def _post(self, post, gate: Gate | None = None) -> Batch:
        """post(copier)'s job as a batch (a peer shrinking the regions fails it: a SIGBUS
        the copier survives); gated, on the second copier right behind `gate`'s job (the
        two posted under the lock, so the gate guards this job). The memory it touches is
        held while it is posted: a free that began before is refused here, one after it
        waits for the copiers (HostQueue)."""
        if self._copier is None:
            raise TransferError("the link was closed")
        try:
            held = _extents.hold(self._touched)
        except ClosedHandleError as e:
            raise TransferError(f"cannot copy: {e}") from None
        try:
            with self._lock:
                if self._copier is None:
                    raise TransferError("the link was closed")
                if gate is None:
                    return _ShmBatch(post(self._copier))
                if self._gated is None:
                    self._gated = _core.Copier(self._targets[0], self._sizes, self._spans)
                    _extents.mark_queued(self._touched, self._gated)
                opens = self._gated.post_gate(gate.signals, gate.until, gate.timeout)
                try:
                    return _ShmBatch(post(self._gated), opens)
                except BaseException:  # refused: its gate guards nothing (the next is a gate)
                    opens.cancel()
                    raise
        finally:
            _extents.release(held)

    def close(self) -> None:
        """Unmap the destination's regions (their records stay: the endpoint's own), once
        no other link of this process maps them, after the copies queued ran. Idempotent."""
        self._targets = ([], [])
        with self._lock:
            copiers = [c for c in (self._copier, self._gated) if c is not None]
            self._copier = self._gated = None
        for copier in copiers:
            copier.destroy()  # runs what was queued: nothing copies into what is unmapped
            _extents.forget_queued(self._touched, copier)
        while self._names:
            _unmap(self._names.pop())
        with self._exit_lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd, self._exit = -1, None


class ShmTransport(Transport):
    name = "shm"
    #: A batch is done once the copier's memmove wrote its every byte into the mapped
    #: destination: done at the target.
    completion = "target"
    #: A submit only queues the copies on the link's copier thread.
    posts = True
    #: The copier thread waits for a layer's signal itself (submit_blocks' gate).
    gates = True
    #: memmove: host memory on both sides.
    memory = ("cpu",)
    #: The shared-file format is pdhal's own.
    version = __version__

    def __init__(self, connect_timeout: float = 0.0):
        """`connect_timeout`: how long a link waits for a described region's record (0: a
        description is made once its regions are published, so none is waited for)."""
        self._timeout = connect_timeout

    def endpoint(self, regions: list, name: str) -> Endpoint:
        return ShmEndpoint(regions, name)

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> Link:
        try:
            return ShmLink(described, sources, self._timeout)
        except InvalidArgumentError:  # a description that is wrong: it names what
            raise
        except PdhalError as e:
            raise TransferError(f"cannot map the destination's memory: {e}") from None
