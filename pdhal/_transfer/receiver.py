"""The decode side of layer-wise transfers: its caches made reachable through a transport,
and the outcome of every request it expects, read from its status slots, each bounded by a
deadline (a prefill side, messager or link that dies or stalls ends the request as failed
when the deadline passes; nothing waits on it).

No write after give-up: a request failed by its deadline is reported at once, but its
blocks (and its status slot) stay held until the prefill side can no longer write them:
until its own end of the request arrives in the slot (the prefill side writes that word
last, after every data write of it settled, and ends the request by the ticket's timeout
at the latest), or the engine says it is gone (release()). freed() names them then."""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import threading
import time
import uuid
from dataclasses import dataclass

from pdhal import ops
from pdhal._errors import (
    ChannelBusyError,
    ClosedHandleError,
    InvalidArgumentError,
    PdhalError,
    TransferError,
)
from pdhal._protocol.names import namespace, validate_name
from pdhal._transfer import checks, mailbox
from pdhal._transfer.contract import require_memory
from pdhal._transfer.layout import CacheLayout
from pdhal._transfer.outcome import Outcome
from pdhal._transfer.plugins import transport
from pdhal._transfer.staging import Staging, needs_staging

CLOSED = "the receiver was closed"

#: The (namespace, name) of this process's open receivers. An endpoint name is unique on its
#: host: a transport refuses one another process serves, and this refuses one served here
#: (over any transport), since a second receiver of one name would be handed the first
#: one's transfers.
_open_names: set[tuple[str, str]] = set()
_names_lock = threading.Lock()


@dataclass
class _Expected:
    slot: int
    generation: int
    deadline: float
    timeout: float
    layerwise: bool
    blocks: list[int] | None = None  # where it goes (staging: what is copied as it lands)
    staged: int = 0  # staging: its layers copied into the caches, from the first


class KVReceiver:
    """Expect requests into `layout`'s caches; describe() is what the prefill side connects
    to (JSON-able), expect() the ticket it sends with each request's destination blocks.

    Caches in memory the transport does not serve, where it serves host memory (device
    memory over shm), are staged (pdhal.transfer's staging): the transport is given a
    pinned host mirror of them, and each request's blocks (expect's `blocks`) are copied
    into them by the backend's runtime before it is reported landed, layer by layer for a
    layerwise one (layers_landed). describe() says so ("staged": the caches' kinds).

    Thread-safe. close() ends it: every call after it (or blocked in wait() while it ran)
    raises ClosedHandleError("the receiver was closed"), and close() itself returns the
    outcomes not reported yet, so that each expected request is reported exactly once."""

    def __init__(
        self, layout: CacheLayout, name: str, *, transport_name: str = "shm", slots: int = 256
    ):
        validate_name(name, "name")
        if not isinstance(layout, CacheLayout):
            raise InvalidArgumentError(f"layout must be a CacheLayout, got {layout!r}")
        slots = checks.integer(slots, "slots", 1, 1 << 16)
        key = (namespace(), name)
        with _names_lock:
            if key in _open_names:
                raise ChannelBusyError(
                    errno.EBUSY,
                    f"a KVReceiver named {name!r} is open in this process (pid {os.getpid()}) "
                    f"already: close it first, or pick another name (an endpoint name is "
                    f"unique on its host)",
                )
            _open_names.add(key)
        self._key = key
        self.layout = layout
        self.transport_name = transport_name
        try:
            self._status = ops.host_alloc(slots * mailbox.SLOT_BYTES)
        except BaseException:
            self._forget_name()
            raise
        ctypes.memset(self._status.address, 0, slots * mailbox.SLOT_BYTES)
        self._view = memoryview(
            (ctypes.c_char * (slots * mailbox.SLOT_BYTES)).from_address(self._status.address)
        ).cast("B")
        self._unpin = None
        self._staging: Staging | None = None
        try:
            served = layout
            if needs_staging(transport(transport_name), layout):
                self._staging = Staging(layout, transport(transport_name).memory)
                served = self._staging.mirror
            require_memory(transport(transport_name), served.memory, "the decode caches'")
            self._unpin = layout.pin("KVReceiver")  # no free of the caches it serves
            self._endpoint = transport(transport_name).endpoint(
                [*served.memory, self._status], name
            )
        except BaseException:
            if self._unpin is not None:
                self._unpin()
            if self._staging is not None:
                self._staging.close()
            self._view.release()
            ops.host_free(self._status)
            self._forget_name()
            raise
        self._served = served
        # A token naming this receiver in its description and in every ticket: a prefill
        # side refuses a ticket sent to another receiver's destination.
        self._token = uuid.uuid4().hex
        # Guards everything below and the status view: close() releases the view under it,
        # so no reader is inside the view then.
        self._lock = threading.Lock()
        self._closed = False
        self._woken = threading.Event()  # set by close(): wakes every wait() at once
        # first in, first out: a slot given up on (its deadline passed) is handed out again
        # as late as can be, so a stalled prefill side's late write to it meets its own
        # generation's request, or a slot nobody reads
        self._free = collections.deque(range(slots))
        self._generations = [0] * slots
        self._expected: dict[str, _Expected] = {}
        #: failed while their prefill side may still write them (by their deadline, an
        #: abandon(unwritten=False), a layer's staging copy)
        self._held: dict[str, _Expected] = {}
        self._ended: list[Outcome] = []
        self._freed: list[str] = []  # held ones let go since the last freed()

    def _forget_name(self) -> None:
        with _names_lock:
            _open_names.discard(self._key)

    def _check_open(self) -> None:
        """ClosedHandleError once close() ran (under the lock)."""
        if self._closed:
            raise ClosedHandleError(CLOSED)

    def describe(self) -> dict:
        """The transport's description, the layout (block sizes, blocks per cache), the
        status region's index and this receiver's token ("receiver", as in its tickets)."""
        with self._lock:
            self._check_open()
        out = self._endpoint.describe()
        out["layout"] = self._served.describe()
        if self._staging is not None:
            out["staged"] = list(self.layout.kinds)
        out["status_region"] = len(self.layout.memory)
        out["status_slots"] = len(self._generations)
        out["receiver"] = self._token
        return out

    def expect(
        self, request_id: str, timeout: float, *, layerwise: bool = False, blocks=None
    ) -> dict:
        """Start waiting for `request_id` (ended as failed if nothing landed after `timeout`
        s): the ticket the prefill side needs with its destination blocks. `layerwise`: the
        prefill side also reports each layer as it lands (layers_landed), for a decode side
        that computes layer by layer while the rest arrives; it costs a status write per
        layer. `blocks`: those destination blocks (ids in these caches), which a receiver
        that stages its caches (see the class) needs: it copies them as they land.

        The ticket (JSON-able) holds "request" (`request_id`), "receiver" (this receiver's
        token, as in describe()), "slot", "generation", "layerwise", "timeout" (the
        prefill side ends the request, and writes nothing more of it, once that long
        passed since it was given the ticket) and, given `blocks`, "blocks" (their digest);
        a prefill side refuses it for another request, another receiver's destination, or
        other destination blocks."""
        request_id = checks.name(request_id, "request_id")
        timeout = checks.seconds(timeout, "timeout")
        layerwise = checks.flag(layerwise, "layerwise")
        if blocks is not None:
            limit = self.layout.num_blocks
            blocks = checks.block_ids(blocks, "blocks", limit, "decode caches", unique=True)
        elif self._staging is not None:
            raise InvalidArgumentError(
                f"this receiver stages its {'/'.join(dict.fromkeys(self.layout.kinds))} caches "
                f"through pinned host memory (its transport {self.transport_name!r} moves "
                f"host memory only): expect() needs the request's blocks, to copy them as "
                f"they land"
            )
        with self._lock:
            self._check_open()
            if request_id in self._expected:
                raise InvalidArgumentError(f"request {request_id!r} is expected already")
            if request_id in self._held:
                raise InvalidArgumentError(
                    f"request {request_id!r}'s blocks are still held (its prefill side may "
                    f"still write them): expect it again once freed() names it, or release() it"
                )
            if not self._free:
                raise InvalidArgumentError(
                    f"all {len(self._generations)} status slots are expected: raise slots, or "
                    f"poll() for the outcomes of the requests in flight"
                )
            slot = self._free.popleft()
            self._generations[slot] = generation = (self._generations[slot] + 1) % (1 << 56)
            self._expected[request_id] = _Expected(
                slot, generation, time.monotonic() + timeout, timeout, layerwise, blocks
            )
        ticket = {
            "request": request_id,
            "receiver": self._token,
            "slot": slot,
            "generation": generation,
            "layerwise": layerwise,
            "timeout": timeout,
        }
        if blocks is not None:  # (a staging receiver copies those: no other may be written)
            ticket["blocks"] = checks.blocks_digest(blocks)
        return ticket

    def _read(self, e: _Expected) -> tuple[int, str]:
        offset = e.slot * mailbox.SLOT_BYTES
        return mailbox.read(self._view[offset : offset + mailbox.SLOT_BYTES], e.generation)

    def _scan(self) -> None:
        """Move every request that ended to self._ended, and every held one whose prefill
        side ended it to self._freed (under the lock, while open)."""
        now = time.monotonic()
        for request_id, e in list(self._expected.items()):
            state, reason = self._read(e)
            if state == mailbox.PENDING and now < e.deadline:
                continue
            del self._expected[request_id]
            if state == mailbox.LANDED and self._staging is not None:
                reason = self._stage(e, self.layout.num_layers)
                state = mailbox.LANDED if reason == "" else mailbox.FAILED
            if state != mailbox.PENDING:
                self._ended.append(Outcome(request_id, state == mailbox.LANDED, reason))
                self._free.append(e.slot)
                continue
            reason = (
                f"nothing landed within {e.timeout:g} s: the prefill side, its messager or "
                f"the link died or stalled"
            )
            self._ended.append(Outcome(request_id, False, reason, blocks_free=False))
            self._held[request_id] = e  # its slot too: a late word finds it
        for request_id, e in list(self._held.items()):
            if self._read(e)[0] != mailbox.PENDING:  # the prefill side's last write of it
                self._let_go(request_id)

    def _stage(self, e: _Expected, layers: int) -> str:
        """Copy `e`'s blocks of its layers landed but not copied yet, up to `layers`, from
        the mirror into the caches: "" once done, else why it failed (under the lock)."""
        if layers <= e.staged:
            return ""
        try:
            self._staging.to_caches(e.blocks, range(e.staged, layers))
        except PdhalError as exc:
            return f"copying its blocks from pinned host memory into the caches failed: {exc}"
        e.staged = layers
        return ""

    def _let_go(self, request_id: str) -> None:
        e = self._held.pop(request_id)
        self._free.append(e.slot)
        self._freed.append(request_id)

    def freed(self) -> list[str]:
        """The requests failed while their prefill side could still write them
        (Outcome.blocks_free False) whose blocks may go back to the allocator now, named
        once each: their prefill side ended them
        (every write of theirs has landed), or release() said it is gone."""
        with self._lock:
            self._check_open()
            self._scan()
            out, self._freed = self._freed, []
        return out

    def held(self) -> list[str]:
        """The requests failed whose blocks are still held (blocks_free False)."""
        with self._lock:
            self._check_open()
            self._scan()
            return list(self._held)

    def release(self, request_id: str) -> None:
        """The engine knows `request_id`'s prefill side can no longer write its blocks (its
        process is gone, or its link closed and its registration revoked): let them go
        (freed() names it). A held request only; one not held is an InvalidArgumentError."""
        request_id = checks.name(request_id, "request_id")
        with self._lock:
            self._check_open()
            self._scan()
            if request_id not in self._held:
                raise InvalidArgumentError(f"request {request_id!r} is not held")
            self._let_go(request_id)

    def abandon(self, request_id: str, reason: str, *, unwritten: bool) -> None:
        """End expected request `request_id` now, as failed with `reason` (its decode
        request was aborted, its prefill side said it will not send it, its control link
        went). `unwritten`: its prefill side said nothing of it was or will be written, so
        its blocks are free at once; otherwise they stay held like a request failed by its
        deadline (freed() names it once its prefill side's end arrives, or release()).
        InvalidArgumentError for a request not expected (or reported already)."""
        request_id = checks.name(request_id, "request_id")
        reason = checks.name(reason, "reason")
        unwritten = checks.flag(unwritten, "unwritten")
        with self._lock:
            self._check_open()
            self._scan()
            e = self._expected.pop(request_id, None)
            if e is None:
                raise InvalidArgumentError(f"request {request_id!r} is not expected")
            self._ended.append(Outcome(request_id, False, reason, blocks_free=unwritten))
            if unwritten:
                self._free.append(e.slot)
            else:
                self._held[request_id] = e

    def poll(self) -> list[Outcome]:
        """The requests that ended and were not reported yet: landed, failed (with the
        prefill side's reason), or failed by their deadline."""
        with self._lock:
            self._check_open()
            self._scan()
            ended, self._ended = self._ended, []
        return ended

    def layers_landed(self, request_id: str) -> int:
        """How many of `request_id`'s layers, from the first, are in the caches: each as it
        lands for a layerwise ticket (else 0), all of them once it landed. Raises
        TransferError with the reason once it failed, InvalidArgumentError if it is not
        expected (or poll() reported it already)."""
        request_id = checks.name(request_id, "request_id")
        with self._lock:
            self._check_open()
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
            count = mailbox.read_progress(
                self._view[offset : offset + mailbox.SLOT_BYTES], e.generation
            )
            # a shared word is input: a prefill side writes at most num_layers - 1 there
            # (the last layer's news is the outcome), so a larger count is no count at all
            count = count if count < self.layout.num_layers else 0
            if self._staging is not None:
                failure = self._stage(e, count)
                if failure:  # its prefill side may write on (into the mirror): held
                    del self._expected[request_id]
                    self._ended.append(Outcome(request_id, False, failure, blocks_free=False))
                    self._held[request_id] = e
                    raise TransferError(failure)
            return count

    def wait(self, request_id: str, poll_interval: float = 0.001) -> Outcome:
        """Poll until `request_id` ended (by its deadline at the latest); the outcomes of
        other requests met meanwhile stay for poll(). ClosedHandleError if the receiver is
        closed meanwhile."""
        request_id = checks.name(request_id, "request_id")
        poll_interval = checks.seconds(poll_interval, "poll_interval")
        while True:
            with self._lock:
                self._check_open()
                self._scan()
                for index, outcome in enumerate(self._ended):
                    if outcome.request_id == request_id:
                        return self._ended.pop(index)
                e = self._expected.get(request_id)
                if e is None:
                    raise InvalidArgumentError(f"request {request_id!r} is not expected")
                # The slot is written by the prefill side through a transport (a remote
                # write into this memory), which wakes nobody here: so this polls, never
                # sleeping past the request's deadline; close() wakes it at once.
                pause = min(poll_interval, max(0.0, e.deadline - time.monotonic()))
            self._woken.wait(pause)  # outside the lock: poll() and the others go on

    def close(self) -> list[Outcome]:
        """Stop serving: the endpoint goes and the status memory is freed. Returns the
        outcomes not reported yet (the last poll()): those that ended, and every request
        still expected, failed with "the receiver was closed" and blocks_free False (a
        prefill side still sending to it learns of the endpoint's end from its transport,
        and may write until then: give those blocks back only once it is gone). Every
        later call, and a wait() blocked meanwhile, raises ClosedHandleError. Idempotent:
        again, it returns []."""
        with self._lock:
            if self._closed:
                return []
            self._scan()
            ended = self._ended + [
                Outcome(r, False, CLOSED, blocks_free=False) for r in self._expected
            ]
            self._ended, self._expected = [], {}
            self._closed = True
            self._woken.set()
        self._unpin()
        try:
            self._endpoint.close()
        finally:
            if self._staging is not None:
                self._staging.close()
            self._view.release()
            ops.host_free(self._status)
            self._forget_name()
        return ended

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
