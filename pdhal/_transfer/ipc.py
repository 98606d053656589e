"""The `ipc` transport (built in): one vendor's device memory, both sides on one host. The
endpoint publishes each device region as its runtime's IPC handle (set_data_ipc, as shm's
endpoint publishes host memory; its status words stay host memory); a link maps them as
shm's does (a handle is opened by the runtime of the backend that made it: a description
from another backend is refused naming both, so a CUDA handle never reaches an XPU
runtime), watches the peer as shm's does, and copies each run into device memory with this
process's runtime, then waits for the runtime: a submit returns once those bytes are in
the destination's memory. Runs into host memory (status words) go to shm's copier.

It moves device memory to device memory and host memory to host memory (`pairs`): device
caches whose other side is another vendor's, or host memory, go over shm, staged through
pinned host memory (staging). Its connect takes each source's kind of memory
(Transport.source_kinds), the direction a runtime's copy needs."""

from __future__ import annotations

import bisect
import contextlib
import threading

import pdhal
from pdhal import ops
from pdhal._errors import InvalidArgumentError, PdhalError, TransferError, UnsupportedError
from pdhal._inputs.tensors import MemoryRef
from pdhal._memory.blocks import MemorySpan
from pdhal._transfer.contract import Batch, Link, Run, Transport
from pdhal._transfer.kit import LandedBatch
from pdhal._transfer.shm import ShmEndpoint, ShmLink
from pdhal._version import __version__


class IpcEndpoint(ShmEndpoint):
    """Each region published as NAME.r<i>: device memory as its runtime's IPC handle."""

    def describe(self) -> dict:
        return super().describe() | {
            "transport": IpcTransport.name,
            "backend": pdhal.current_platform().name,  # whose runtime alone opens the handles
        }


def _sources(sources: object) -> list[tuple[int, int, str]]:
    """`sources` as (address, bytes, kind of memory), the kind checked to be a word (the
    address and bytes are checked by the link's RunChecker)."""
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
        if not isinstance(kind, str) or not kind.isidentifier():
            raise InvalidArgumentError(
                f"sources[{index}]'s kind of memory must be a word ('cpu', 'gpu', 'xpu'), "
                f"got {kind!r}"
            )
        out.append((span[0], span[1], kind))
    return out


class IpcLink(ShmLink):
    """shm's link over device regions: the same mapping, checks and watch of the peer; runs
    into a device region are copied by this process's runtime, one copy per run (runs of
    one size in one call), then waited for."""

    def __init__(self, described: dict, sources: list, timeout: float, backend: str):
        theirs = described.get("backend") if isinstance(described, dict) else backend
        if theirs != backend:  # (a description that is no dict: ShmLink names what it lacks)
            raise InvalidArgumentError(
                f"the destination's memory is shared by the {theirs!r} backend's runtime, this "
                f"process's is {backend!r}: the ipc transport opens one vendor's IPC handles "
                f"with that vendor's runtime; between two backends use shm (device caches "
                f"staged through pinned host memory)"
            )
        spans = _sources(sources)
        self._copy_lock = threading.Lock()  # the runtime's copies of a submit against close
        super().__init__(described, [(a, n) for a, n, _ in spans], timeout)
        self._kinds = sorted((a, a + n, kind) for a, n, kind in spans)
        self._starts = [start for start, _, _ in self._kinds]
        #: Each destination region's device ("cpu" for host memory), from what it mapped to.
        self._devices = [extent.device for extent in self._targets[1]]

    #: Block runs are expanded into runs here (the contract's default), not handed to
    #: shm's copier, whose memmove cannot read or write device memory.
    submit_blocks = Link.submit_blocks

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
            there, here = self._devices[region].split(":")[0], self._kind_of(src)
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
        if by_size:
            self._copy_on_device(by_size)
        if host:
            return self._post(lambda copier: copier.post_runs(host))
        return LandedBatch()

    def _copy_on_device(self, by_size: dict[int, list[Run]]) -> None:
        """Copy the runs (by their bytes) with the runtime, and wait for them."""
        with self._copy_lock:
            addresses, extents = self._targets
            if not addresses:
                raise TransferError("the link was closed")
            try:
                for nbytes, runs in by_size.items():
                    dst, src = [], []
                    for source, region, offset, _ in runs:
                        extent = extents[region]
                        at = addresses[region] + offset
                        dst.append(MemorySpan(MemoryRef(at, nbytes, extent.device, extent=extent)))
                        src.append(MemorySpan(MemoryRef(source, nbytes, extent.device)))
                    ops.copy_blocks(dst, [0], src, [0], nbytes)
                ops.synchronize()
            except PdhalError as e:
                # the copies queued before the one that failed run on: wait for them, so
                # that none lands after this submit failed
                with contextlib.suppress(PdhalError):
                    ops.synchronize()
                raise TransferError(
                    f"the runtime's copy into the destination failed: {e}"
                ) from None

    def close(self) -> None:
        with self._copy_lock:  # no runtime copy of a submit into what close unmaps
            super().close()


class IpcTransport(Transport):
    name = "ipc"
    #: A submit returns once the runtime finished its copies into the destination (and a
    #: batch of status words once shm's copier wrote them): done at the target.
    completion = "target"
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
        #: This process's device memory, and host memory (the status words).
        self.memory = (kind, "cpu")
        self.pairs = ((kind, kind), ("cpu", "cpu"))

    def endpoint(self, regions: list, name: str) -> IpcEndpoint:
        return IpcEndpoint(regions, name)

    def connect(self, described: dict, sources: list) -> IpcLink:
        try:
            return IpcLink(described, sources, self._timeout, self._backend)
        except InvalidArgumentError:  # a description that is wrong: it names what
            raise
        except PdhalError as e:
            raise TransferError(f"cannot map the destination's memory: {e}") from None
