"""The outcome of each transfer, where the destination side reads it: one 128-byte slot per
expected request in a status region the destination's endpoint serves with its caches.

A slot holds a word, (generation << 8) | state; its progress, (generation << 16) | layers
landed (the generation's low 48 bits; written only for a layerwise ticket); then a
failure's reason: its generation (8 bytes) and up to 104 bytes of UTF-8. The source side
writes a failure's reason first and its word last, in separate submits, so the word never
names a reason not yet there. A slot is handed out again under a new generation, and a
word, progress or reason of another generation (a late write for a request given up on)
is not this request's."""

from __future__ import annotations

import struct

SLOT_BYTES = 128
PROGRESS_AT = 8
REASON_AT = 16  # the reason's generation, then its text
REASON_TEXT = SLOT_BYTES - REASON_AT - 8
PENDING, LANDED, FAILED = 0, 1, 2
PROGRESS_GENERATIONS = (1 << 48) - 1


def word(generation: int, state: int) -> bytes:
    return struct.pack("<Q", (generation << 8) | state)


def progress(generation: int, layers: int) -> bytes:
    return struct.pack("<Q", ((generation & PROGRESS_GENERATIONS) << 16) | layers)


def read_progress(slot: memoryview, generation: int) -> int:
    """Layers landed of `slot` for `generation`: 0 while its progress is another's."""
    (value,) = struct.unpack_from("<Q", slot, PROGRESS_AT)
    return value & 0xFFFF if value >> 16 == generation & PROGRESS_GENERATIONS else 0


def reason_bytes(generation: int, reason: str) -> bytes:
    """The reason area of a slot: the generation it belongs to, then the text."""
    text = reason.encode("utf-8", "replace")[:REASON_TEXT].ljust(REASON_TEXT, b"\0")
    return struct.pack("<Q", generation) + text


def read(slot: memoryview, generation: int) -> tuple[int, str]:
    """(state, reason) of `slot` for `generation`: PENDING while its word is another's."""
    (value,) = struct.unpack_from("<Q", slot, 0)
    state = value & 0xFF
    if value >> 8 != generation or state not in (LANDED, FAILED):
        return PENDING, ""
    if state == LANDED:
        return LANDED, ""
    (owner,) = struct.unpack_from("<Q", slot, REASON_AT)
    if owner != generation:
        return FAILED, "the prefill side failed it (its reason did not arrive)"
    text = bytes(slot[REASON_AT + 8 : SLOT_BYTES]).rstrip(b"\0")
    return FAILED, text.decode("utf-8", "replace")
