"""Tensor parallelism in pdhal.transfer: a prefill instance split over P ranks and a decode
instance over D ranks, each rank its own KVStreamer or KVReceiver (the receivers in real
decode processes). 4 KV heads of 16 bytes per block; every source byte says which (layer,
cache, block, head) it is, so each decode rank is checked to hold exactly the heads it owns,
from the prefill rank that holds them, and nothing where no shard wrote. A mapping that
cannot pair is refused before the first byte moves."""

from __future__ import annotations

import numpy as np
import pytest

import pdhal
from pdhal import transfer
from pdhal.testing.transfer_peers import (
    BLOCK_TOKENS,
    BLOCKS,
    CACHES,
    LAYERS,
    Decode,
    outcomes_until,
)

HEADS, HEAD_BYTES = 4, 16


def head_pattern(layer: int, cache: int, block: int, head: int) -> int:
    return (layer * 61 + cache * 17 + block * 5 + head * 37 + 1) % 251


def rank_streamer(rank: int, ranks: int):
    """The KVStreamer of prefill rank `rank` of `ranks`: its share of the heads, each
    block head-major."""
    held = transfer.rank_heads(HEADS, ranks, rank)
    caches = []
    for layer in range(LAYERS):
        row = []
        for cache in range(CACHES):
            a = np.empty((BLOCKS, len(held), HEAD_BYTES), np.uint8)
            for block in range(BLOCKS):
                for i, head in enumerate(held):
                    a[block, i] = head_pattern(layer, cache, block, head)
            row.append(a.reshape(BLOCKS, -1))
        caches.append(row)
    layout = transfer.CacheLayout(
        [c for row in caches for c in row],
        [
            [
                transfer.CacheSpec(
                    layer * CACHES + c,
                    0,
                    len(held) * HEAD_BYTES,
                    len(held) * HEAD_BYTES,
                    BLOCKS,
                    len(held),
                )
                for c in range(CACHES)
            ]
            for layer in range(LAYERS)
        ],
    )
    streamer = transfer.KVStreamer(layout, BLOCK_TOKENS, claim_timeout=30)
    streamer.caches = caches  # kept alive with it
    return streamer


def rank_decode(rank: int, ranks: int) -> Decode:
    held = len(transfer.rank_heads(HEADS, ranks, rank))
    return Decode(f"tp-decode{rank}of{ranks}", heads=held, block_bytes=held * HEAD_BYTES)


def held_bytes(decode: Decode, rank: int, ranks: int, block: int, src_block: int | None):
    """Whether every (layer, cache) of `block` on decode rank `rank` holds its heads of
    `src_block` (None: still zero)."""
    held = transfer.rank_heads(HEADS, ranks, rank)
    for layer in range(LAYERS):
        for cache in range(CACHES):
            got = decode.block(layer, cache, block)
            want = []
            for head in held:
                value = 0 if src_block is None else head_pattern(layer, cache, src_block, head)
                want += [value] * HEAD_BYTES
            if got != want:
                return False
    return True


@pytest.mark.parametrize(
    ("prefill_ranks", "decode_ranks"), [(1, 2), (2, 1), (2, 2)], ids=["1to2", "2to1", "2to2"]
)
def test_each_decode_rank_gets_exactly_its_heads_from_the_ranks_that_hold_them(
    prefill_ranks, decode_ranks
):
    """Request "a" (source blocks 1, 2 on every prefill rank) goes to blocks 5, 6 on every
    decode rank, one ticket per shard; the other blocks stay zero. Before the last shard of
    a decode rank lands, the heads other shards bring are still zero there. The blocks are
    consecutive on both sides, so a shard into a rank holding more heads (2 -> 1) is a
    strided destination: one run copied as one span would overwrite the other shard's
    heads."""
    shards = transfer.head_shards(HEADS, prefill_ranks, decode_ranks)
    streamers = [rank_streamer(r, prefill_ranks) for r in range(prefill_ranks)]
    decodes = [rank_decode(d, decode_ranks) for d in range(decode_ranks)]
    try:
        for (r, d), shard in sorted(shards.items()):
            streamer, decode = streamers[r], decodes[d]
            ticket = decode.expect(f"a@{r}>{d}")  # one name for the part on both sides
            dest = streamer.connect(decode.described, heads=shard)
            streamer.add_request(f"a@{r}>{d}", [1, 2], 2 * BLOCK_TOKENS)
            streamer.set_destination(f"a@{r}>{d}", dest, [5, 6], ticket)
        for r, streamer in enumerate(streamers):
            mine = sorted(d for (q, d) in shards if q == r)
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [(f"a@{r}>{d}", 2 * BLOCK_TOKENS) for d in mine])
            landed = outcomes_until(streamer, len(mine))
            assert sorted(o.request_id for o in landed if o.landed) == [f"a@{r}>{d}" for d in mine]
            if r == 0 and (1, 0) in shards:  # decode rank 0 waits for rank 1's heads
                assert not held_bytes(decodes[0], 0, decode_ranks, 5, 1)
        for d, decode in enumerate(decodes):
            for r in sorted(q for (q, e) in shards if e == d):
                assert decode.wait(f"a@{r}>{d}")[0], f"shard {r} -> {d}"
            assert held_bytes(decode, d, decode_ranks, 5, 1)
            assert held_bytes(decode, d, decode_ranks, 6, 2)
            assert all(held_bytes(decode, d, decode_ranks, b, None) for b in (0, 1, 2, 3, 4, 7))
    finally:
        for streamer in streamers:
            streamer.close()
        for decode in decodes:
            decode.close()


def test_the_shards_follow_vllm_s_split_of_kv_heads():
    """Rank r of N holds heads [r*H/N, (r+1)*H/N), or head r*H//N when the heads are
    replicated (fewer than the ranks); each decode head comes from one prefill rank."""
    assert transfer.head_shards(4, 2, 1) == {
        (0, 0): transfer.HeadShard(0, 0, 2),
        (1, 0): transfer.HeadShard(0, 2, 2),
    }
    assert transfer.head_shards(4, 1, 2) == {
        (0, 0): transfer.HeadShard(0, 0, 2),
        (0, 1): transfer.HeadShard(2, 0, 2),
    }
    assert transfer.head_shards(4, 4, 2) == {
        (0, 0): transfer.HeadShard(0, 0, 1),
        (1, 0): transfer.HeadShard(0, 1, 1),
        (2, 1): transfer.HeadShard(0, 0, 1),
        (3, 1): transfer.HeadShard(0, 1, 1),
    }
    # 2 heads over 4 prefill ranks (each replicated twice) to 1 decode rank: one source each
    assert transfer.head_shards(2, 4, 1) == {
        (0, 0): transfer.HeadShard(0, 0, 1),
        (2, 0): transfer.HeadShard(0, 1, 1),
    }
    assert list(transfer.rank_heads(2, 4, 3)) == [1]
    with pytest.raises(pdhal.InvalidArgumentError, match="6 KV heads do not split over 4"):
        transfer.head_shards(6, 4, 1)


def test_a_mapping_that_does_not_pair_is_refused_before_anything_moves():
    """A decode rank whose heads are another size (head size or dtype differ), or whose
    caches do not count their heads, is refused at connect, naming what differs."""
    streamer = rank_streamer(0, 1)
    wide = Decode("tp-wide", heads=2, block_bytes=2 * 24)
    whole = Decode("tp-whole", heads=1, block_bytes=2 * HEAD_BYTES)
    try:
        shard = transfer.head_shards(HEADS, 1, 2)[(0, 1)]
        with pytest.raises(
            pdhal.InvalidArgumentError, match="a head's part of a block is 16 bytes here, 24"
        ):
            streamer.connect(wide.described, heads=shard)
        with pytest.raises(pdhal.InvalidArgumentError, match=r"holds 1 head\(s\) on the peer"):
            streamer.connect(whole.described, heads=shard)
        with pytest.raises(pdhal.InvalidArgumentError, match="blocks of 64 bytes here, 32"):
            streamer.connect(whole.described)  # no shard: whole blocks must pair
        with pytest.raises(pdhal.InvalidArgumentError, match="heads must be a HeadShard"):
            streamer.connect(whole.described, heads=(0, 0, 2))
        assert streamer.metrics.snapshot()["bytes_landed"] == 0
        assert all(
            set(decode.block(layer, cache, block)) == {0}
            for decode in (wide, whole)
            for layer in range(LAYERS)
            for cache in range(CACHES)
            for block in range(BLOCKS)
        )
    finally:
        streamer.close()
        wide.close()
        whole.close()
