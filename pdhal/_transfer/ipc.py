"""The `ipc` transport (built in): one vendor's device memory, both sides on one host. The
endpoint publishes each device region as its runtime's IPC handle (set_data_ipc, as shm's
endpoint publishes host memory; its status words stay host memory); a link maps them as
shm's does (a handle is opened by the runtime of the backend that made it: a description
from another backend is refused naming both, so a CUDA handle never reaches an XPU
runtime), watches the peer as shm's does, and hands each submit's runs into device memory
to a copy thread of its own, which copies them with this process's runtime and waits for
the runtime: their batch is done once those bytes are in the destination's memory, and a
device that stalls holds up that thread, never the submitter (the batch fails by its
wait). Runs into host memory (status words) go to shm's copier.

It moves device memory to device memory and host memory to host memory (`pairs`): device
caches whose other side is another vendor's, or host memory, go over shm, staged through
pinned host memory (staging). Its connect takes each source's kind of memory
(Transport.source_kinds), the direction a runtime's copy needs, and refuses one it does
not move or that pdhal knows to be another. A link checks the peer's region sizes against
what its handles map, which needs a runtime that can say how large an opened IPC
allocation is (cuda's; xpu's cannot: an xpu process serves ipc endpoints, and links from
none)."""

from __future__ import annotations

import bisect
import contextlib
import queue
import threading
import time

import pdhal
from pdhal import ops
from pdhal._errors import (
    BatchFailedError,
    InvalidArgumentError,
    PdhalError,
    TransferError,
    UnsupportedError,
)
from pdhal._inputs.tensors import MemoryRef
from pdhal._memory import extents as _extents
from pdhal._memory.blocks import MemorySpan
from pdhal._transfer.contract import Batch, Link, Run, Transport
from pdhal._transfer.kit import LandedBatch
from pdhal._transfer.shm import ShmEndpoint, ShmLink
from pdhal._version import __version__

#: How long a link's close waits for its copy thread to run what was queued before it
#: leaves the rest of the close to that thread (a stalled device's copies).
CLOSE_WAIT_S = 1.0


class IpcEndpoint(ShmEndpoint):
    """Each region published as NAME.r<i>: device memory as its runtime's IPC handle."""

    def describe(self) -> dict:
        return super().describe() | {
            "transport": IpcTransport.name,
            "backend": pdhal.current_platform().name,  # whose runtime alone opens the handles
        }


def _sources(sources: object, kinds: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """`sources` as (address, bytes, kind of memory), each kind one of `kinds` (what the
    transport moves here) and, where pdhal knows the memory, the kind it is (the address
    and bytes are checked by the link's RunChecker)."""
    if isinstance(sources, (str, bytes)) or not hasattr(sources, "__iter__"):
        raise InvalidArgumentError(
            f"sources must be a list of (address, bytes, kind of memory), got {sources!r}"
        )
    out = []
    for index, span in enumerate(sources):
        if not isinstance(span, (tuple, list)) or len(span) != 3:
            raise InvalidArgumentError(
                f"sources[{index}] must be (address, bytes, kind of memory) (the ipc "
                f"transport copies by direction), got {span!r}"
            )
        kind = span[2]
        if kind not in kinds:
            raise InvalidArgumentError(
                f"sources[{index}]'s kind of memory must be one the ipc transport moves here "
                f"({', '.join(kinds)}), got {kind!r}"
            )
        known = _extents.find(span[0]) if type(span[0]) is int else None
        if known is not None and known.device.split(":")[0] != kind:
            raise InvalidArgumentError(
                f"sources[{index}] is said to be {kind} memory, but it lies in pdhal's "
                f"{known.device} memory ({known.what})"
            )
        out.append((span[0], span[1], kind))
    return out


class IpcLink(ShmLink):
    """shm's link over device regions: the same mapping, checks and watch of the peer; runs
    into a device region are copied by this process's runtime, one copy per run (runs of
    one size in one call), then waited for."""

    transport = "ipc"
    maps_device_memory = True

    #: Block runs are expanded into runs here (the contract's default), not handed to
    #: shm's copier, whose memmove cannot read or write device memory.
    submit_blocks = Link.submit_blocks

    def __init__(self, described: dict, sources: list, timeout: float, backend: str, kinds: tuple):
        # (a description that is not an ipc endpoint's: ShmLink names what is wrong)
        ours = isinstance(described, dict) and described.get("transport") == self.transport
        theirs = described.get("backend") if ours else backend
        if theirs != backend:
            raise InvalidArgumentError(
                f"the destination's memory is shared by the {theirs!r} backend's runtime, this "
                f"process's is {backend!r}: the ipc transport opens one vendor's IPC handles "
                f"with that vendor's runtime; between two backends use shm (device caches "
                f"staged through pinned host memory)"
            )
        spans = _sources(sources, kinds)
        self._copy_lock = threading.Lock()  # a submit's runtime copies against close
        self._copies: _CopyThread | None = None  # made at the first device run
        self._closed = False
        self._kinds = sorted((a, a + n, kind) for a, n, kind in spans)
        self._starts = [start for start, _, _ in self._kinds]
        super().__init__(described, [(a, n) for a, n, _ in spans], timeout)

    def _read_here(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The host spans (shm's copier reads them); device memory is read by the runtime."""
        return [(a, n) for a, n in spans if self._kind_of(a) == "cpu"]

    def _kind_of(self, address: int) -> str:
        """The kind of memory of the source span `address` lies in (the runs are checked
        to lie in one)."""
        return self._kinds[bisect.bisect_right(self._starts, address) - 1][2]

    def submit(self, runs: list[Run]) -> Batch:
        why = self.problem()
        if why is not None:
            raise TransferError(why)
        runs = self._runs.check(runs)
        by_size: dict[int, list[Run]] = {}
        host = []
        for index, run in enumerate(runs):
            src, region, _, nbytes = run
            there, here = self.region_kinds[region], self._kind_of(src)
            if there != here:
                raise TransferError(
                    f"run {index} copies {here} memory into {there} memory (region {region}): "
                    f"the ipc transport moves device memory to device memory and host memory "
                    f"to host memory"
                )
            if there == "cpu":
                host.append(run)
            else:
                by_size.setdefault(nbytes, []).append(run)
        batches = []
        if by_size:
            batches.append(self._post_device(by_size))
        if host:
            batches.append(self._post(lambda copier: copier.post_runs(host)))
        if len(batches) > 1:
            return _Together(batches)
        return batches[0] if batches else LandedBatch()

    def _post_device(self, by_size: dict[int, list[Run]]) -> Batch:
        """Queue the runs (by their bytes) on the link's copy thread."""
        with self._copy_lock:
            addresses, extents = self._targets
            if self._closed or not addresses:
                raise TransferError("the link was closed")
            plan = []
            for nbytes, runs in by_size.items():
                dst, src = [], []
                for source, region, offset, _ in runs:
                    extent = extents[region]
                    at = addresses[region] + offset
                    dst.append(MemorySpan(MemoryRef(at, nbytes, extent.device, extent=extent)))
                    src.append(MemorySpan(MemoryRef(source, nbytes, extent.device)))
                plan.append((dst, src, nbytes))
            if self._copies is None:
                self._copies = _CopyThread()
            return self._copies.post(plan)

    def close(self) -> None:
        """Close as shm's link does once the copies queued ran: now, or, where the copy
        thread is still at them after CLOSE_WAIT_S (a stalled device), by that thread once
        they ran (nothing is unmapped under a copy); the caller does not wait for a
        stalled device."""
        with self._copy_lock:
            if self._closed:  # the first close does it (or its copy thread will)
                return
            self._closed = True
            copies, self._copies = self._copies, None
        if copies is None:
            super().close()
        else:
            copies.stop(then=super().close, wait=CLOSE_WAIT_S)


class _DeviceBatch(Batch):
    """One submit's runtime copies: done once the copy thread made them and the runtime
    ran them."""

    __slots__ = ("_settled", "_failure")

    def __init__(self):
        self._settled = threading.Event()
        self._failure: str | None = None

    def settle(self, failure: str | None) -> None:
        self._failure = failure
        self._settled.set()

    def done(self) -> bool:
        if not self._settled.is_set():
            return False
        if self._failure is not None:  # the runtime's copy failed: the link is sound
            raise BatchFailedError(self._failure)
        return True

    def wait(self, timeout: float) -> None:
        if not self._settled.wait(max(timeout, 0.0)):
            raise TransferError(
                f"the runtime's copies into the destination did not finish in the "
                f"{max(timeout, 0.0):.3g} s waited for them (a stalled device, or work queued "
                f"before them that does not end)"
            )
        self.done()


class _Together(Batch):
    """A submit's runtime copies and its runs into host memory (shm's copier): done once
    both are."""

    def __init__(self, batches: list[Batch]):
        self._batches = batches

    def done(self) -> bool:
        return all([batch.done() for batch in self._batches])  # (each raises its failure)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for batch in self._batches:
            batch.wait(deadline - time.monotonic())


class _CopyThread:
    """One link's runtime copies, made and waited for in order on a thread of its own, as
    shm's copier thread makes its memmoves: a submit only queues them, and a device that
    stalls holds up this thread, never the submitter (its batch fails by its wait)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pdhal-ipc-copies", daemon=True)
        self._thread.start()

    def post(self, plan: list) -> _DeviceBatch:
        """Queue `plan`, (destinations, sources, bytes) of one copy_blocks call each."""
        batch = _DeviceBatch()
        self._queue.put((plan, batch))
        return batch

    def _run(self) -> None:
        while not callable(item := self._queue.get()):
            plan, batch = item
            try:
                for dst, src, nbytes in plan:
                    ops.copy_blocks(dst, [0], src, [0], nbytes)
                ops.synchronize()
            except PdhalError as e:
                # the copies queued before the one that failed run on: wait for them, so
                # that none lands after its batch failed
                with contextlib.suppress(PdhalError):
                    ops.synchronize()
                batch.settle(f"the runtime's copy into the destination failed: {e}")
            else:
                batch.settle(None)
        item()  # what stop gave it

    def stop(self, then, wait: float) -> None:
        """End once what was queued is made and ran, calling `then` (on this thread);
        return once it did, or after `wait` s (a stalled device) while it goes on."""
        self._queue.put(then)
        self._thread.join(wait)


class IpcTransport(Transport):
    name = "ipc"
    #: A batch is done once the runtime ran its copies into the destination (and its runs
    #: into host memory once shm's copier wrote them): done at the target.
    completion = "target"
    #: A submit only queues its copies (on the link's copy thread, and shm's copier).
    posts = True
    version = __version__
    #: A source's kind of memory tells the runtime's copy its direction.
    source_kinds = True

    def __init__(self, connect_timeout: float = 0.0):
        """`connect_timeout`: how long a link waits for a described region's record."""
        platform = pdhal.current_platform()
        if not platform.device_kind:
            raise UnsupportedError(
                f"the ipc transport moves device memory through its runtime's IPC handles; "
                f"this process's platform ({platform.name}) has no device memory: use shm"
            )
        kind = platform.device_kind
        self._backend, self._timeout = platform.name, connect_timeout
        self._sizes_known = bool(platform.capabilities.get("ipc_size"))
        #: This process's device memory, and host memory (the status words).
        self.memory = (kind, "cpu")
        self.pairs = ((kind, kind), ("cpu", "cpu"))

    def endpoint(self, regions: list, name: str) -> IpcEndpoint:
        return IpcEndpoint(regions, name)

    def connect(self, described: dict, sources: list) -> IpcLink:
        if not self._sizes_known:
            raise UnsupportedError(
                f"the {self._backend} runtime cannot say how large an opened IPC allocation "
                f"is, so a description's region sizes (a peer's word) cannot be checked "
                f"against what its handles map, and a lying one would have this process copy "
                f"past them: the ipc transport links from {self._backend} memory only where "
                f"the runtime can (cuda); use shm, which stages device caches through pinned "
                f"host memory"
            )
        try:
            return IpcLink(described, sources, self._timeout, self._backend, self.memory)
        except InvalidArgumentError:  # a description that is wrong: it names what
            raise
        except PdhalError as e:
            raise TransferError(f"cannot map the destination's memory: {e}") from None
