"""Memory pdhal handed out or mapped, by address, and the ops using it right now.

Two jobs. A raw int address (as engines pass cuda_host_alloc's or get_data_ptr_ipc's results)
is bounded by what pdhal knows of it, never taken on trust. And memory is never released under
an op that uses it: an op holds the extents it reads or writes (`hold`) until it lets go
(`release`); a free, close or unset first retires the extent (`retire`), which refuses new
holds at once and waits for the ops holding it. Work an op queued on a device stream counts
as use until it ran: before it lets go, the op marks its extents with the stream
(mark_queued) and records that stream's fence, and whoever frees waits for the fences of the
streams its extent was marked with (RuntimeBackend.wait_queued) before the memory goes. A
host thread's queue (a HostQueue: the shm transport's copier) is a stream too, drained by
retire itself, so every free of host memory waits for the copies queued on it.

An object that keeps an address for its whole life (a CacheLayout a KVStreamer copies from)
pins the extent instead (`pin`): a free of pinned memory is refused (MemoryPinnedError,
naming who pins it), not waited for, since a pin may last as long as the process. Pins do
not hold: ops on pinned memory run as on any other.
"""

from __future__ import annotations

import bisect
import logging
import threading

from pdhal._errors import ClosedHandleError, MemoryPinnedError
from pdhal._protocol.core import HostQueue


class Extent:
    """One range of memory pdhal knows: [start, start + nbytes) on `device`."""

    __slots__ = ("start", "nbytes", "device", "what", "holders", "retired", "streams", "pins")

    def __init__(self, start: int, nbytes: int, device: str, what: str):
        self.start = start
        self.nbytes = nbytes
        self.device = device  # "cpu", "gpu:0", "xpu:1", ...
        self.what = what  # where it came from, for messages ("host_alloc", "shared buffer 'kv'")
        self.holders = 0  # ops using it now
        self.retired = False  # freed (or being freed): no op may start on it
        self.streams: set[object] = set()  # (device, stream) keys that had work queued on it
        self.pins: list[str] = []  # who pins it (one entry per pin): no free while any

    def __repr__(self) -> str:
        return f"Extent({self.what}, {self.start:#x}, nbytes={self.nbytes}, {self.device})"


log = logging.getLogger("pdhal")

#: How long a free waits for the ops using its memory before it logs who they are (and waits
#: on): a copy lasts milliseconds, so this long means an op that never let go.
STILL_WAITING_S = 10.0

_starts: list[int] = []
_extents: dict[int, Extent] = {}
_replaced: dict[int, list[Extent]] = {}  # start -> earlier extents there, still named by objects
_lock = threading.Lock()
_let_go = threading.Condition(_lock)  # notified when a retired extent's last holder lets go


def register(start: int, nbytes: int, device: str, what: str) -> Extent:
    """Remember [start, start + nbytes); a later range at the same start replaces it for
    find(), and retiring that start retires both (one mapping named by two objects). The
    same range registered again for the same reason is the extent it already is."""
    extent = Extent(start, nbytes, device, what)
    with _lock:
        old = _extents.get(start)
        if old is not None and (old.nbytes, old.device, old.what) == (nbytes, device, what):
            return old
        if old is None:
            bisect.insort(_starts, start)
        else:
            _replaced.setdefault(start, []).append(old)
        _extents[start] = extent
    return extent


def find(address: int) -> Extent | None:
    """The known range holding `address`, or None."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None
        extent = _extents[_starts[i]]
    return extent if address < extent.start + extent.nbytes else None


def retire(extent: Extent | int) -> set[object]:
    """Take `extent` (or every range registered at that start address) out of use before
    its memory goes: new holds are refused from now on, and this returns once no op holds
    it. Returns the streams that had work queued on it, for the caller to wait for (see the
    module's docstring). Idempotent. MemoryPinnedError, retiring nothing, while one of them
    is pinned."""
    with _lock:
        if isinstance(extent, int):
            current = _extents.get(extent)
            _refuse_pinned(_replaced.get(extent, []) + ([current] if current else []))
            retiring = _replaced.pop(extent, []) + ([current] if current else [])
        else:
            current = _extents.get(extent.start) is extent
            _refuse_pinned([extent] + (_replaced.get(extent.start, []) if current else []))
            retiring = [extent]
            shadowed = _replaced.get(extent.start, [])
            if extent in shadowed:
                shadowed.remove(extent)
        for one in retiring:
            one.retired = True
            if _extents.get(one.start) is one:
                del _extents[one.start]
                del _starts[bisect.bisect_left(_starts, one.start)]
                for earlier in _replaced.pop(one.start, []):
                    earlier.retired = True
                    retiring.append(earlier)
        while any(one.holders for one in retiring):
            if not _let_go.wait(STILL_WAITING_S):  # an op that never lets go: say so, wait on
                busy = ", ".join(f"{one} ({one.holders} ops)" for one in retiring if one.holders)
                log.warning("a free has waited %.0f s for ops using %s", STILL_WAITING_S, busy)
        streams = {stream for one in retiring for stream in one.streams}
    queues = {stream for stream in streams if isinstance(stream, HostQueue)}
    for queue in queues:  # no new work reaches them (new holds are refused): drain what did
        queue.drain()
    return streams - queues


def _refuse_pinned(retiring: list[Extent]) -> None:
    """MemoryPinnedError if one of `retiring` (what a retire would take) is pinned; with
    _lock held."""
    for one in retiring:
        if one.pins:
            owners = sorted(set(one.pins))
            them = "it" if len(one.pins) == 1 else "them"
            raise MemoryPinnedError(
                f"cannot free {one.what} at {one.start:#x}: held by {', '.join(owners)}: "
                f"close {them} first"
            )


def pin(extents, owner: str) -> list[Extent]:
    """Pin each of `extents` (None entries and repeats skipped) for `owner` (who to name in
    a refused free): until unpin, retire() refuses them. The pinned ones, for unpin().
    ClosedHandleError, pinning none, if one is retired."""
    pinned = list(dict.fromkeys(extent for extent in extents if extent is not None))
    with _lock:
        for extent in pinned:
            if extent.retired:
                raise ClosedHandleError(f"{extent.what} at {extent.start:#x} was freed")
        for extent in pinned:
            extent.pins.append(owner)
    return pinned


def unpin(pinned: list[Extent], owner: str) -> None:
    """Undo pin(`pinned`, `owner`) (once per pin: the caller makes a second call harmless)."""
    with _lock:
        for extent in pinned:
            extent.pins.remove(owner)


def mark_queued(held: list[Extent], stream: object) -> None:
    """The op holding `held` queued work that uses them on `stream` (a key of the
    backend's: its fence is what a free of them waits for)."""
    with _lock:
        for extent in held:
            extent.streams.add(stream)


def forget_queued(extents, stream: object) -> None:
    """`stream` queues no more work on `extents` (its queue closed, drained)."""
    with _lock:
        for extent in extents:
            extent.streams.discard(stream)


def streams_in_use() -> set[object]:
    """The streams that copies queued on memory still in use (not retired) went to."""
    with _lock:
        live = list(_extents.values()) + [e for shadowed in _replaced.values() for e in shadowed]
        return {stream for extent in live for stream in extent.streams}


def hold(extents) -> list[Extent]:
    """Mark each of `extents` (None entries skipped) in use by the calling op; the held ones,
    for release(). ClosedHandleError, holding none, if one is retired."""
    held = [extent for extent in extents if extent is not None]
    with _lock:
        for extent in held:
            if extent.retired:
                for other in held:
                    if other is extent:
                        break
                    other.holders -= 1
                _let_go.notify_all()
                raise ClosedHandleError(f"{extent.what} at {extent.start:#x} was freed")
            extent.holders += 1
    return held


def release(held: list[Extent]) -> None:
    """The op that held `held` lets go (work it queued was marked with mark_queued)."""
    if not held:
        return
    retiring = False
    with _lock:
        for extent in held:
            extent.holders -= 1
            retiring = retiring or extent.retired
        if retiring:
            _let_go.notify_all()
