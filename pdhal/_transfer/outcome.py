"""How a transfer ended, as each side hears it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """A request's transfer ended: landed (every layer's blocks are in the destination),
    or failed with `reason` (the prefill side may free its blocks; the decode side must
    not decode from them). Each request ends exactly once on each side."""

    request_id: str
    landed: bool
    reason: str = ""
