"""The outcome of each transfer, where the destination side reads it: one 64-byte slot per
expected request in a status region the destination's endpoint serves with its caches.

A slot holds a word, (generation << 8) | state, and after it a reason of up to 56 bytes
(UTF-8). The source side writes a failure's reason first and its word last, in separate
submits, so the word never names a reason not yet there; a generation that is not the
slot's current one (a late write for a request given up on) is ignored."""

from __future__ import annotations

import struct

SLOT_BYTES = 64
REASON_BYTES = SLOT_BYTES - 8
PENDING, LANDED, FAILED = 0, 1, 2


def word(generation: int, state: int) -> bytes:
    return struct.pack("<Q", (generation << 8) | state)


def reason_bytes(reason: str) -> bytes:
    data = reason.encode("utf-8", "replace")[:REASON_BYTES]
    return data.ljust(REASON_BYTES, b"\0")


def read(slot: memoryview, generation: int) -> tuple[int, str]:
    """(state, reason) of `slot` for `generation`: PENDING while it names another."""
    (value,) = struct.unpack_from("<Q", slot, 0)
    if value >> 8 != generation or value & 0xFF not in (LANDED, FAILED):
        return PENDING, ""
    reason = bytes(slot[8:SLOT_BYTES]).rstrip(b"\0").decode("utf-8", "replace")
    return value & 0xFF, reason
