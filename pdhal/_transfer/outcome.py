"""How a transfer ended, as each side hears it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from . import checks


@dataclass(frozen=True)
class Outcome:
    """A request's transfer ended: landed (every layer's blocks are in the destination),
    or failed with `reason` (the prefill side may free its blocks; the decode side must
    not decode from them). Each request ends exactly once on each side.

    `blocks_free` (decode side): whether its blocks may go back to the allocator now.
    False for a request the decode side ended by its own deadline while the prefill side
    had not ended it: a prefill side that was only slow may still write them, so they are
    the engine's again only once KVReceiver.freed() names the request."""

    request_id: str
    landed: bool
    reason: str = ""
    blocks_free: bool = True


class Outcomes:
    """Ended requests waiting for the engine's poll: put by a transfer's threads, taken
    all at once by the engine, whose poll may wait for the next one (woken by it)."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._items: list[Outcome] = []

    def put(self, outcome: Outcome) -> None:
        with self._ready:
            self._items.append(outcome)
            self._ready.notify_all()

    def take(self, timeout: object = 0.0) -> list[Outcome]:
        """Every outcome put since the last take; waits up to `timeout` seconds (0: not
        at all) for one when there is none."""
        timeout = checks.timeout_or_zero(timeout, "timeout")
        with self._ready:
            if timeout:
                self._ready.wait_for(lambda: self._items, timeout)
            out, self._items = self._items, []
        return out
