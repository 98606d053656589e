"""The transport contract: what moves a transfer's bytes between two processes' memory.

A transport plugin returns a Transport (entry-point group `pdhal.transports`, hook
`pdhal_transport`). The destination side makes its memory reachable (`endpoint`) and hands
the source side the endpoint's `describe()` (JSON-able); the source side opens a Link to it
(`connect`) and submits runs, each (source address, destination region, offset in that
region, bytes). A Batch is one submit: it completes, or fails with the reason, exactly once.
The transport conformance kit (`pytest --pdhal-transport NAME`) checks every promise here.
"""

from __future__ import annotations

import bisect
from typing import ClassVar

from pdhal._errors import InvalidArgumentError, TransferError
from pdhal._inputs.tensors import memory_ref

#: One copy: (source address, destination region index, byte offset in it, bytes).
Run = tuple[int, int, int, int]


def region_bytes(regions: list) -> list[int]:
    """The bytes of each region an endpoint serves (memory pdhal can name, with a size)."""
    sizes = [memory_ref(region, f"region {i}").nbytes for i, region in enumerate(regions)]
    if None in sizes:
        raise InvalidArgumentError("a region must be memory with a size (a tensor or buffer)")
    return sizes


def region_devices(regions: list) -> list[str]:
    """Where each region lives: "cpu", "cuda:0", "xpu:1", ... ("unknown" for a bare
    address), for a transport that registers host and device memory differently."""
    return [memory_ref(region, f"region {i}").device for i, region in enumerate(regions)]


class RunChecker:
    """What a Link's submit refuses before the first byte moves: a run outside the
    destination's regions (`regions`: their bytes), or read from outside the memory the
    link was given to copy from (`sources`: (address, bytes))."""

    def __init__(self, regions: list[int], sources: list[tuple[int, int]]):
        self.regions = list(regions)
        self._sources = sorted((int(a), int(a) + int(n)) for a, n in sources)
        self._starts = [a for a, _ in self._sources]

    def check(self, runs: list[Run]) -> None:
        sizes, starts, sources = self.regions, self._starts, self._sources
        low = high = 0  # the source range the last run was in: runs come grouped by cache
        for src, region, offset, nbytes in runs:
            if not 0 <= region < len(sizes) or offset < 0 or offset + nbytes > sizes[region]:
                raise TransferError(
                    f"a run of {nbytes} bytes at offset {offset} of region {region} is outside "
                    f"the destination ({len(sizes)} regions of {sizes} bytes)"
                )
            if not (low <= src and src + nbytes <= high):
                at = bisect.bisect_right(starts, src) - 1
                low, high = sources[at] if at >= 0 else (0, 0)
                if not low <= src or src + nbytes > high:
                    raise TransferError(
                        f"a run's source [{src:#x}, +{nbytes}) is outside the memory this link "
                        f"was given to copy from"
                    )


class Batch:
    """The runs of one submit, in flight."""

    def done(self) -> bool:
        """True once every run landed; False while in flight. Raises TransferError (with
        the reason) once it failed."""
        raise NotImplementedError

    def wait(self, timeout: float) -> None:
        """Return once every run landed; TransferError if it failed, or is still in flight
        after `timeout` seconds (a stalled peer or link)."""
        raise NotImplementedError


class Link:
    """The source side's connection to one endpoint."""

    #: The endpoint's regions, as many as it described (their bytes).
    regions: list[int]

    def submit(self, runs: list[Run]) -> Batch:
        """Start the copies; TransferError if they cannot be started (a dead peer, a run
        outside a region or outside the memory registered on this side). Runs in flight
        together (of one submit, or of submits not yet landed) must not overlap in the
        destination: the order they land in is the transport's. A submit made after
        another landed lands after it."""
        raise NotImplementedError

    def problem(self) -> str | None:
        """None while the peer looks alive; else why not (checked before each submit)."""
        return None

    def close(self) -> None:
        """Forget the peer; batches still in flight may fail."""


class Endpoint:
    """The destination side: its regions, reachable by the transport's links."""

    def describe(self) -> dict:
        """What a source side needs to connect (JSON-able; "transport" names this one)."""
        raise NotImplementedError

    def close(self) -> None:
        """Make the regions unreachable again."""


class Transport:
    """Moves bytes between processes. One per process and name (`pdhal.transfer.transport`)."""

    #: The name plugins register under ("shm", "mooncake", ...).
    name: ClassVar[str] = ""

    def endpoint(self, regions: list, name: str) -> Endpoint:
        """Make `regions` (memory objects pdhal knows: tensors, host buffers) reachable
        under `name` (unique on this host)."""
        raise NotImplementedError

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> Link:
        """A Link to the endpoint `described`, copying from `sources` ((address, bytes) of
        this side's memory, registered with the transport here)."""
        raise NotImplementedError
