"""Benchmark: pdhal.transfer between caches of different block sizes, or of another order
inside a block, against the same bytes between caches alike, side by side in one run
(issue 35's target: >= 0.8x).

One process holds a KVStreamer over prefill caches of 64-token blocks and a KVReceiver over
decode caches (shm transport; the copies run on the link's copier thread), each layer K
and V, head-major (BENCH_HEADS heads, 4 by default; a head's token 64 bytes, then 256). Each
round sends, in turn, one step of BENCH_REQUESTS requests of 8 prefill blocks each to decode
caches of 64-token blocks (alike: block runs expanded in C), of 16 (each prefill block four
decode blocks), of 48 (sizes that do not divide: units of 16 tokens), and of 64 tokens
token-major (NHD against the prefill's HND: a copy per token and head, expanded in C), of
64 tokens keeping each head's K and V together ([blocks, heads, 2, tokens, dim]: a copy per
head and block), and the alike transfer followed by making its blocks token-major on the
decode side (the other way to convert: after landing), every layer ready at once; a mode's
time is from the first layer_ready to the last request landed (and converted). Each row:
GiB/s (median over rounds) and the median of each round's ratio against "alike".
A different block size costs more, smaller copies: one per head and per stretch inside one
block on both sides, where alike blocks of consecutive ids are one copy per run; another
order one per token and head (each stretch one grid of them, expanded in C on the shm
link's copier, which runs a prefill block's stretches head by head, so each head's tokens
are read in order, and moves a piece below a page inline, 64 bytes at a time). What
copies that size cost by themselves is each row's "pieces alone": the same bytes copied
in C in the mode's sizes, a memcpy each, contiguous, against a memcpy per block
(bench/c_pieces.c, nothing scattered; pdhal's inline pieces can beat it).
`--json` prints one object.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import statistics
import sys
import time

import _cbuild  # (this folder: the script's own)

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
LAYERS = int(os.environ.get("BENCH_LAYERS", "4" if SMOKE else "32"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2" if SMOKE else "9"))
REQUESTS = int(os.environ.get("BENCH_REQUESTS", "2" if SMOKE else "8"))
HEADS = int(os.environ.get("BENCH_HEADS", "4"))
#: The bytes of one token of one head it runs with, in turn: what a copy per token and head
#: moves, against a block's whole bytes alike.
TOKEN_BYTES = {"32 dims of fp16": 64, "128 dims of bf16 (Llama's, Qwen's)": 256}
PREFILL_TOKENS = 64
PER_REQUEST = 8  # prefill blocks
TOKENS = PER_REQUEST * PREFILL_TOKENS  # a prompt
#: Each mode's decode blocks: (tokens, order inside a block, K and V "apart" or "together").
MODES = {
    "alike (64)": (64, "heads", "apart"),
    "decode blocks of 16": (16, "heads", "apart"),
    "decode blocks of 48": (48, "heads", "apart"),
    "decode token-major (64)": (64, "tokens", "apart"),
    "decode K, V together (64)": (64, "heads", "together"),
}


def caches(
    block_tokens: int, blocks: int, token_bytes: int, order: str = "heads", kv: str = "apart"
):
    """Each layer's K and V: a buffer each ("apart"), or one buffer whose blocks keep each
    head's K and V together ("together": [blocks, heads, 2, tokens, dim], CacheSpec
    head_stride)."""
    from pdhal import ops, transfer

    part = block_tokens * token_bytes  # a head's
    block = HEADS * part
    if kv == "apart":
        buffers = [ops.host_alloc(blocks * block) for _ in range(2 * LAYERS)]
        specs = [
            [
                transfer.CacheSpec(2 * layer + k, 0, block, block, blocks, HEADS, "", 1, order)
                for k in range(2)
            ]
            for layer in range(LAYERS)
        ]
    else:
        buffers = [ops.host_alloc(2 * blocks * block) for _ in range(LAYERS)]
        specs = [
            [
                transfer.CacheSpec(
                    layer, k * part, 2 * block, block, blocks, HEADS, "", 1, order, 2 * part
                )
                for k in range(2)
            ]
            for layer in range(LAYERS)
        ]
    return transfer.CacheLayout(buffers, specs), buffers


#: Alike blocks landed, then made token-major on the decode side (numpy, a core of its
#: own): what a conversion after landing would cost, against converting on the way.
CONVERTED = "alike, then converted on decode"


def _convert(layout, token_bytes: int) -> float:
    """Seconds to make every block of `layout` (head-major, 64 tokens) token-major, into
    a buffer of its own per cache, as a decode-side conversion after landing would."""
    import numpy as np

    start = time.perf_counter()
    for region in layout.memory:
        blocks = region.nbytes // (HEADS * 64 * token_bytes)
        heads_major = region.as_numpy(np.uint8, (blocks, HEADS, 64, token_bytes))
        np.ascontiguousarray(heads_major.transpose(0, 2, 1, 3))
    return time.perf_counter() - start


def piece_sizes(tokens: int, order: str, kv: str, token_bytes: int) -> list[int]:
    """The sizes of the copies a mode makes of prefill blocks, in order, over a whole number
    of prefill blocks: a block each where alike; else a copy per head of each stretch inside
    one block on both sides, per head and block where K and V are together, per token and
    head where the orders differ."""
    if order == "tokens":
        return [token_bytes] * (HEADS * PREFILL_TOKENS)
    if kv == "together":
        return [PREFILL_TOKENS * token_bytes] * HEADS
    if tokens == PREFILL_TOKENS:
        return [HEADS * PREFILL_TOKENS * token_bytes]
    period = math.lcm(PREFILL_TOKENS, tokens)
    cuts = sorted({*range(0, period + 1, PREFILL_TOKENS), *range(0, period + 1, tokens)})
    return [(end - start) * token_bytes for start, end in zip(cuts, cuts[1:]) for _ in range(HEADS)]


@functools.cache
def _c_pieces() -> ctypes.CDLL:
    """bench/c_pieces.c, built and loaded once per run."""
    library = ctypes.CDLL(
        _cbuild.build(os.path.join(os.path.dirname(__file__), "c_pieces.c"), "libc_pieces.so")
    )
    library.pieces_vs_blocks.restype = ctypes.c_double
    u64 = ctypes.c_uint64
    library.pieces_vs_blocks.argtypes = [u64, u64, ctypes.POINTER(u64), u64, ctypes.c_int]
    return library


def pieces_alone(mode: str, token_bytes: int, nbytes: int) -> float:
    """A memcpy per block over a memcpy per copy of `mode`, `nbytes` of each
    (bench/c_pieces.c)."""
    u64 = ctypes.c_uint64
    sizes = piece_sizes(*MODES[mode], token_bytes)
    block = HEADS * PREFILL_TOKENS * token_bytes
    period = sum(sizes)
    ratio = _c_pieces().pieces_vs_blocks(
        nbytes // period * period, block, (u64 * len(sizes))(*sizes), len(sizes), ROUNDS
    )
    assert ratio > 0, (mode, sizes)
    return ratio


def main() -> dict:
    """Each head size's modes: GiB/s and the ratio against alike."""
    os.environ["PDHAL_NAMESPACE"] = f"benchsizes{os.getpid()}"
    return {head: measure(token_bytes) for head, token_bytes in TOKEN_BYTES.items()}


def measure(token_bytes: int) -> dict:
    from pdhal import ops, transfer

    prefill_blocks = REQUESTS * PER_REQUEST
    source, owned = caches(PREFILL_TOKENS, prefill_blocks, token_bytes)
    streamer = transfer.KVStreamer(source, PREFILL_TOKENS, max_layers_in_flight=8)
    sides = {}
    for name, (tokens, order, kv) in MODES.items():
        blocks = -(-TOKENS // tokens) * REQUESTS
        layout, buffers = caches(tokens, blocks, token_bytes, order, kv)
        owned += buffers
        receiver = transfer.KVReceiver(
            layout, f"benchsizes-{tokens}-{order}-{kv}-{token_bytes}-{os.getpid()}", slots=64
        )
        dest = streamer.connect(receiver.describe(), block_tokens=tokens)
        sides[name] = (receiver, dest, tokens)
    nbytes = LAYERS * 2 * REQUESTS * TOKENS * HEADS * token_bytes
    seconds = {name: [] for name in [*MODES, CONVERTED]}
    serial = 0
    for _ in range(ROUNDS):
        for name, (receiver, dest, tokens) in sides.items():
            ids = [f"r{token_bytes}-{serial}-{i}" for i in range(REQUESTS)]
            serial += 1
            per = -(-TOKENS // tokens)
            for i, request in enumerate(ids):
                src = list(range(i * PER_REQUEST, (i + 1) * PER_REQUEST))
                streamer.add_request(request, src, TOKENS)
                dst = list(range(i * per, (i + 1) * per))[::-1]  # scattered on the decode side
                streamer.set_destination(request, dest, dst, receiver.expect(request, 60))
            start = time.perf_counter()
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [(r, TOKENS) for r in ids])
            ended = []
            while len(ended) < REQUESTS:
                ended += streamer.poll(10)
            seconds[name].append(time.perf_counter() - start)
            assert all(o.landed for o in ended), ended
            for request in ids:
                assert receiver.wait(request).landed
            if name == "alike (64)":  # the other way to token-major: land, then convert
                seconds[CONVERTED].append(
                    seconds[name][-1] + _convert(receiver.layout, token_bytes)
                )
    streamer.close()
    for receiver, _, _ in sides.values():
        receiver.close()
    for buffer in owned:
        ops.host_free(buffer)
    alike = seconds["alike (64)"]
    return {
        name: {
            "gib_s": nbytes / statistics.median(times) / 2**30,
            "vs_alike": statistics.median(a / t for a, t in zip(alike, times)),
            "pieces_alone": pieces_alone(name, token_bytes, nbytes) if name in MODES else None,
        }
        for name, times in seconds.items()
    }


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        print(f"{LAYERS} layers x K, V; {REQUESTS} requests of {TOKENS} tokens; {HEADS} heads")
        for head, rows in result.items():
            print(f"heads of {head}:")
            for name, row in rows.items():
                alone = row["pieces_alone"]
                print(
                    f"  {name:<32} {row['gib_s']:6.2f} GiB/s   {row['vs_alike']:5.2f}x alike"
                    + (f"   (pieces alone {alone:.2f}x)" if alone else "")
                )
        print("target (issue 35): >= 0.8x alike")
