"""How a transfer ended, as each side hears it."""

from __future__ import annotations

from dataclasses import dataclass


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
