"""The decode side of layer-wise transfers: its caches made reachable through a transport,
and the outcome of every request it expects, read from its status slots, each bounded by a
deadline (a prefill side, messager or link that dies or stalls ends the request as failed
when the deadline passes; nothing waits on it)."""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from dataclasses import dataclass

from pdhal import ops
from pdhal._errors import InvalidArgumentError, TransferError
from pdhal._protocol.names import validate_name
from pdhal._transfer import mailbox
from pdhal._transfer.layout import CacheLayout, seconds
from pdhal._transfer.outcome import Outcome
from pdhal._transfer.plugins import transport


@dataclass
class _Expected:
    slot: int
    generation: int
    deadline: float
    timeout: float
    layerwise: bool


class KVReceiver:
    """Expect requests into `layout`'s caches; describe() is what the prefill side connects
    to (JSON-able), expect() the ticket it sends with each request's destination blocks."""

    def __init__(
        self, layout: CacheLayout, name: str, *, transport_name: str = "shm", slots: int = 256
    ):
        validate_name(name, "name")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 1 << 16:
            raise InvalidArgumentError(f"slots must be an int in [1, 65536], got {slots!r}")
        self.layout = layout
        self._status = ops.host_alloc(slots * mailbox.SLOT_BYTES)
        ctypes.memset(self._status.address, 0, slots * mailbox.SLOT_BYTES)
        self._view = memoryview(
            (ctypes.c_char * (slots * mailbox.SLOT_BYTES)).from_address(self._status.address)
        ).cast("B")
        try:
            self._endpoint = transport(transport_name).endpoint(
                [*layout.memory, self._status], name
            )
        except BaseException:
            self._view.release()
            ops.host_free(self._status)
            raise
        self._lock = threading.Lock()
        # first in, first out: a slot given up on (its deadline passed) is handed out again
        # as late as can be, so a stalled prefill side's late write to it meets its own
        # generation's request, or a slot nobody reads
        self._free = collections.deque(range(slots))
        self._generations = [0] * slots
        self._expected: dict[str, _Expected] = {}
        self._ended: list[Outcome] = []

    def describe(self) -> dict:
        """The transport's description, the layout (block sizes, blocks per cache) and the
        status region's index."""
        out = self._endpoint.describe()
        out["layout"] = self.layout.describe()
        out["status_region"] = len(self.layout.memory)
        out["status_slots"] = len(self._generations)
        return out

    def expect(self, request_id: str, timeout: float, *, layerwise: bool = False) -> dict:
        """Start waiting for `request_id` (ended as failed if nothing landed after `timeout`
        s): the ticket the prefill side needs with its destination blocks. `layerwise`: the
        prefill side also reports each layer as it lands (layers_landed), for a decode side
        that computes layer by layer while the rest arrives; it costs a status write per
        layer."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        timeout = seconds(timeout, "timeout")
        if not isinstance(layerwise, bool):
            raise InvalidArgumentError(f"layerwise must be a bool, got {layerwise!r}")
        with self._lock:
            if request_id in self._expected:
                raise InvalidArgumentError(f"request {request_id!r} is expected already")
            if not self._free:
                raise InvalidArgumentError(
                    f"all {len(self._generations)} status slots are expected: raise slots, or "
                    f"poll() for the outcomes of the requests in flight"
                )
            slot = self._free.popleft()
            self._generations[slot] = generation = (self._generations[slot] + 1) % (1 << 56)
            self._expected[request_id] = _Expected(
                slot, generation, time.monotonic() + timeout, timeout, layerwise
            )
        return {
            "request": request_id,
            "slot": slot,
            "generation": generation,
            "layerwise": layerwise,
        }

    def _scan(self) -> None:
        """Move every request that ended to self._ended (under the lock)."""
        now = time.monotonic()
        for request_id, e in list(self._expected.items()):
            offset = e.slot * mailbox.SLOT_BYTES
            state, reason = mailbox.read(
                self._view[offset : offset + mailbox.SLOT_BYTES], e.generation
            )
            if state == mailbox.PENDING and now < e.deadline:
                continue
            if state == mailbox.PENDING:
                reason = (
                    f"nothing landed within {e.timeout:g} s: the prefill side, its messager "
                    f"or the link died or stalled"
                )
            self._ended.append(Outcome(request_id, state == mailbox.LANDED, reason))
            del self._expected[request_id]
            self._free.append(e.slot)

    def poll(self) -> list[Outcome]:
        """The requests that ended and were not reported yet: landed, failed (with the
        prefill side's reason), or failed by their deadline."""
        with self._lock:
            self._scan()
            ended, self._ended = self._ended, []
        return ended

    def layers_landed(self, request_id: str) -> int:
        """How many of `request_id`'s layers, from the first, are in the caches: each as it
        lands for a layerwise ticket (else 0), all of them once it landed. Raises
        TransferError with the reason once it failed, InvalidArgumentError if it is not
        expected (or poll() reported it already)."""
        with self._lock:
            self._scan()
            for outcome in self._ended:
                if outcome.request_id == request_id:
                    if not outcome.landed:
                        raise TransferError(outcome.reason)
                    return self.layout.num_layers
            e = self._expected.get(request_id)
            if e is None:
                raise InvalidArgumentError(f"request {request_id!r} is not expected")
            if not e.layerwise:
                return 0
            offset = e.slot * mailbox.SLOT_BYTES
            return mailbox.read_progress(
                self._view[offset : offset + mailbox.SLOT_BYTES], e.generation
            )

    def wait(self, request_id: str, poll_interval: float = 0.001) -> Outcome:
        """Poll until `request_id` ended (by its deadline at the latest); the outcomes of
        other requests met meanwhile stay for poll()."""
        while True:
            with self._lock:
                self._scan()
                for index, outcome in enumerate(self._ended):
                    if outcome.request_id == request_id:
                        return self._ended.pop(index)
                if request_id not in self._expected:
                    raise InvalidArgumentError(f"request {request_id!r} is not expected")
            time.sleep(poll_interval)

    def close(self) -> None:
        """Stop serving: the endpoint goes, the expected requests are forgotten."""
        self._endpoint.close()
        self._view.release()
        ops.host_free(self._status)
