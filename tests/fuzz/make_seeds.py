#!/usr/bin/env python3
"""Write the seed corpus of tests/fuzz/fuzz_segment.c into tests/fuzz/corpus/ (stdlib only).

Each seed is a selector byte followed by what the harness reads for that mode (see the
comment at the top of fuzz_segment.c):

  selector bit 0 = 0, validate: the rest is a segment file, written as is (mode 0600). Layout
    from csrc/internal.h: a 256-byte header (magic u64 @0, version u32 @8, kind u32 @12,
    size u64 @16, creator_pid i32 @24, creator_uid u32 @28 (0 here: the core checks the
    file's owner, not this field), ring_slots u32 @32,
    max_requests u32 @36, body_bytes u64 @40, progress u64 @64, seq u32 @72,
    latest_step u64 @80, consumed u64 @128, reader_pid i32 @144), then per-chunk ring slots
    of 6208 bytes each (progress u64 @0, count u32 @8, num_layers u32 @12, table i32[1536]
    @16), or, for a buffer, the payload at 4096.
  selector bit 0 = 1, hostile: ring-slot byte, legit-traffic byte, then ops (OP_* below).

Usage: python3 tests/fuzz/make_seeds.py [OUTDIR]   (default: tests/fuzz/corpus next to it)
"""

import os
import struct
import sys

MAGIC = 0x4745534C41484450  # "PDHALSEG" little-endian
VERSION = 1
KIND_QUERY, KIND_CHUNK, KIND_BUFFER = 1, 2, 3
HEADER = 256
SLOT = 8 + 4 + 4 + 4 * 1536 + 48  # sizeof(struct pdhal_ring_slot) = 6208
BUFFER_HEADER = 4096
MAX_REQUESTS = 512
LAYER_BITS = 20

# Selector bits of the validate mode.
FIX_MAGIC, FIX_SIZE, FIX_LAYOUT = 0x02, 0x04, 0x08
CREATE_OVER, ODD_ENTRY = 0x40, 0x80  # ODD_ENTRY | 0x00: a symlink at the path
# Ops of the hostile mode, in the order of `enum op` in fuzz_segment.c.
(
    OP_WRITE_HEADER,
    OP_WRITE_FIELD,
    OP_WRITE_PROGRESS,
    OP_WRITE_COUNT,
    OP_WRITE_LAYERS,
    OP_WRITE_TABLE,
    OP_WRITE_RAW,
    OP_NEXT,
    OP_ACK,
    OP_BEGIN_STEP,
    OP_PUBLISH,
    OP_STORE,
    OP_WAIT,
    OP_PROBE,
    OP_RESTART_READER,
) = range(15)
# Header fields OP_WRITE_FIELD picks from, in the harness's order.
F_PROGRESS, F_SEQ, F_WAITERS, F_LATEST, F_CONSUMED, F_READER_SEQ, F_READER_WAITERS, F_PID = range(8)


def header(kind, size, ring_slots=0, body_bytes=0, progress=0, latest_step=0, consumed=0):
    h = bytearray(HEADER)
    struct.pack_into(
        "<QIIQiIIIQ",
        h,
        0,
        MAGIC,
        VERSION,
        kind,
        size,
        1,
        0,
        ring_slots,
        MAX_REQUESTS if kind == KIND_CHUNK else 0,
        body_bytes,
    )
    struct.pack_into("<Q", h, 64, progress)
    struct.pack_into("<Q", h, 80, latest_step)
    struct.pack_into("<Q", h, 128, consumed)
    return bytes(h)


def ring_slot(step=0, ready_layers=0, table=(), num_layers=1):
    s = bytearray(SLOT)
    struct.pack_into(
        "<QII",
        s,
        0,
        (step << LAYER_BITS) | ready_layers if step else 0,
        len(table) // 3,
        num_layers,
    )
    struct.pack_into(f"<{len(table)}i", s, 16, *table)
    return bytes(s)


def seeds():
    query = header(KIND_QUERY, HEADER, progress=(3 << LAYER_BITS) | 2)
    yield "validate-query", bytes([0x00]) + query

    # A per-chunk segment of 2 slots, step 1 published in slot 1 with its only layer ready.
    chunk = header(KIND_CHUNK, HEADER + 2 * SLOT, ring_slots=2, latest_step=1)
    chunk += ring_slot() + ring_slot(step=1, ready_layers=1, table=(0, 0, 16), num_layers=1)
    yield "validate-chunk", bytes([0x00]) + chunk

    body = bytes(range(64))
    buf = header(KIND_BUFFER, BUFFER_HEADER + len(body), body_bytes=len(body))
    buf += bytes(BUFFER_HEADER - HEADER) + body
    yield "validate-buffer", bytes([0x00]) + buf

    # Header only, resized by the harness (FIX_LAYOUT) to 3 slots: the fuzzer reaches the
    # ring with a 257-byte input.
    short = header(KIND_CHUNK, 0, ring_slots=3, latest_step=0)
    yield "validate-chunk-layout", bytes([FIX_MAGIC | FIX_LAYOUT]) + short
    # A buffer header with a wrong size field, fixed up (file and field) by FIX_LAYOUT.
    yield "validate-buffer-layout", bytes([FIX_LAYOUT]) + header(KIND_BUFFER, 1, body_bytes=100)
    # The query header behind a symlink (refused), and a create over the stale query file.
    yield "validate-symlink", bytes([ODD_ENTRY]) + query
    yield "validate-create-over", bytes([CREATE_OVER]) + query

    # Hostile: 2 slots, two steps published (2 layers each), one record read.
    yield "hostile-plain", bytes([0x01, 0, 0x12 | 0x04])
    # A slot's count past PDHAL_MAX_REQUESTS, then a read.
    yield (
        "hostile-count",
        bytes([0x01, 1, 0x11, OP_WRITE_COUNT, 1])
        + struct.pack("<I", 0xFFFFFFFF)
        + bytes([OP_NEXT, 0]),
    )
    # latest_step at its maximum, then a new step; consumed far ahead.
    yield (
        "hostile-latest",
        bytes(
            [
                0x01,
                2,
                0x01,
                OP_WRITE_FIELD,
                F_LATEST,
                1,
                OP_BEGIN_STEP,
                1,
                3,
                1,
                0,
                2,
                0,
                3,
                0,
                OP_WRITE_FIELD,
                F_CONSUMED,
                2,
            ]
        )
        + struct.pack("<Q", 1 << 40)
        + bytes([OP_NEXT, 0, OP_ACK]),
    )
    # A slot's progress a step ahead of the reader (lapped), num_layers huge, a small buffer.
    yield (
        "hostile-lapped",
        bytes([0x01, 3, 0x01, OP_WRITE_PROGRESS, 1, 2])
        + struct.pack("<Q", (9 << LAYER_BITS) | 1)
        + bytes([OP_WRITE_LAYERS, 1])
        + struct.pack("<I", 0xFFFFFFFF)
        + bytes(
            [
                OP_NEXT,
                0x81,
                OP_NEXT,
                0,
                OP_PUBLISH,
                0xFF,
                1,
                OP_STORE,
                5,
                0,
                1,
                OP_WAIT,
                1,
                1,
                OP_PROBE,
            ]
        ),
    )

    # The reader restarts with consumed set far back, while a step is begun without it.
    yield (
        "hostile-restart",
        bytes([0x01, 0, 0x13, OP_NEXT, 0, OP_WRITE_FIELD, F_CONSUMED, 2])
        + struct.pack("<Q", 0)
        + bytes(
            [
                OP_RESTART_READER,
                1,
                2,
                2,
                5,
                0,
                6,
                0,
                7,
                0,
                8,
                0,
                9,
                0,
                10,
                0,
                OP_NEXT,
                0,
                OP_NEXT,
                0,
            ]
        ),
    )


def main():
    out = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    )
    os.makedirs(out, exist_ok=True)
    total = 0
    for name, data in seeds():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        total += len(data)
    print(f"wrote {len(list(seeds()))} seeds ({total} bytes) to {out}")


if __name__ == "__main__":
    main()
