"""One decode side a streamer sends to: its link, how blocks become bytes there, and the
machinery that keeps it apart from every other decode side: its own window of submits in
flight, the sends waiting for that window, the thread that completes its submits in order,
and the buffers its status words go out from."""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
from dataclasses import dataclass

from pdhal._transfer import mailbox
from pdhal._transfer.contract import Batch, Link
from pdhal._transfer.layout import RunPlanner

#: Status words one destination may have going out at once.
STATUS_BUFFERS = 64


@dataclass(eq=False)
class Send:
    """One layer's newly sendable blocks of some requests, to one destination."""

    layer: int
    items: list  # (request, blocks) it carries
    copies: list  # the transport's runs
    nbytes: int
    signal_ns: int
    step: int | None  # the engine's, if it said
    batch: Batch | None = None  # once submitted
    submit_ns: int = 0


class StatusBuffers:
    """Source memory for status words: a buffer is never handed out again while a submit
    that may still read it is unsettled (a wait that timed out poisons it for good)."""

    def __init__(self, count: int = STATUS_BUFFERS):
        self._memory = (ctypes.c_char * (count * mailbox.SLOT_BYTES))()
        self.address, self.nbytes = ctypes.addressof(self._memory), count * mailbox.SLOT_BYTES
        self._free = collections.deque(range(count))
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """The address of a free buffer, or None when every one is in use or poisoned."""
        with self._lock:
            return self.address + self._free.popleft() * mailbox.SLOT_BYTES if self._free else None

    def give_back(self, address: int) -> None:
        with self._lock:
            self._free.append((address - self.address) // mailbox.SLOT_BYTES)


class Destination:
    """A decode side, connected (KVStreamer.connect)."""

    def __init__(
        self,
        link: Link,
        planner: RunPlanner,
        status_region: int,
        status_slots: int,
        window: int,
        status: StatusBuffers,
    ):
        self.link, self.planner = link, planner
        self.status_region, self.status_slots, self.status = status_region, status_slots, status
        #: Submits in flight at most (max_layers_in_flight).
        self.window = threading.BoundedSemaphore(window)
        self.backlog: collections.deque[Send] = collections.deque()  # waiting for the window
        self.queue: queue.Queue[Send | None] = queue.Queue()  # in flight, for the thread
        self.outstanding = 0  # queued for the completion thread, or being completed
        self.thread: threading.Thread | None = None
        self.retired = False  # no new sends; its thread closes the link after its last
