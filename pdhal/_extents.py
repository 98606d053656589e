"""How far memory pdhal handed out extends, by address: a raw int address (as engines pass
cuda_host_alloc's or get_data_ptr_ipc's results) is bounded by what pdhal knows of it, never
taken on trust."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """One range of memory pdhal knows: [start, start + nbytes) on `device`."""

    start: int
    nbytes: int
    device: str  # "cpu", "gpu:0", "xpu:1", ...
    what: str  # where it came from, for messages ("host_alloc", "shared buffer 'kv'")


_starts: list[int] = []
_extents: dict[int, Extent] = {}
_lock = threading.Lock()


def register(start: int, nbytes: int, device: str, what: str) -> None:
    """Remember [start, start + nbytes); a later range at the same start replaces it."""
    with _lock:
        if start not in _extents:
            bisect.insort(_starts, start)
        _extents[start] = Extent(start, nbytes, device, what)


def forget(start: int) -> None:
    """Forget the range starting at `start` (freed, unregistered, unmapped)."""
    with _lock:
        if _extents.pop(start, None) is not None:
            del _starts[bisect.bisect_left(_starts, start)]


def find(address: int) -> Extent | None:
    """The known range holding `address`, or None."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None
        extent = _extents[_starts[i]]
    return extent if address < extent.start + extent.nbytes else None
