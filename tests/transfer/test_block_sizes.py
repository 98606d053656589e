"""Prefill and decode caches of different block sizes (issue 35): the streamer plans in
units of the tokens both block sizes are multiples of, so each token of each KV head goes
to where the decode side's block holds it, whether one size divides the other or not,
with a prefix the decode side has and with the prompt ready chunk by chunk. A decode
process's KVReceiver over shm, every byte of every token checked; a pair whose tokens are
not the same bytes is refused at connect, naming both."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

import pdhal
from pdhal import transfer
from pdhal.testing.transfer_peers import BLOCKS, CACHES, LAYERS, Decode, outcomes_until

TOKEN_BYTES = 4  # of one token of one KV head


def value(layer: int, cache: int, block: int, head: int, token: int) -> int:
    """What each byte of one token of one head of a source block holds."""
    return (layer * 61 + cache * 17 + block * 7 + head * 3 + token * 11) % 251 + 1


def source(block_tokens: int, heads: int, planes: int = 1) -> list[list[np.ndarray]]:
    """BLOCKS blocks per cache, each head-major: heads x planes x block_tokens x
    TOKEN_BYTES (a plane's tokens are value()'s of head `heads * plane + head`)."""
    caches = []
    for layer in range(LAYERS):
        row = []
        for cache in range(CACHES):
            a = np.empty((BLOCKS, heads, planes, block_tokens, TOKEN_BYTES), np.uint8)
            for b in range(BLOCKS):
                for h in range(heads):
                    for p in range(planes):
                        for t in range(block_tokens):
                            a[b, h, p, t] = value(layer, cache, b, heads * p + h, t)
            row.append(a.reshape(BLOCKS, -1))
        caches.append(row)
    return caches


def layout_of(caches: list[list[np.ndarray]], heads: int, **spec) -> transfer.CacheLayout:
    """from_caches' layout of `caches`, every CacheSpec with the fields `spec` gives."""
    layout = transfer.CacheLayout.from_caches(caches, heads=heads)
    return transfer.CacheLayout(
        layout.memory,
        [[dataclasses.replace(s, **spec) for s in row] for row in layout.layers],
    )


def stream(streamer, decode, here: int, there: int, tokens: int, cached: int = 0):
    """A `tokens`-token prompt from prefill blocks of `here` tokens into decode blocks of
    `there` (`cached` of them the decode side has), ready in two chunks (7 tokens, then
    all), every layer; it must land on both sides. Its (source, destination) blocks."""
    src_blocks = [5, 2, 7, 0][: -(-tokens // here)]
    dst_blocks = [6, 1, 3, 4][: -(-tokens // there)]
    base = cached * there // here  # the prefill blocks the decode side has whole
    streamer.add_request("r", src_blocks[base:], tokens, cached_blocks=base)
    dest = streamer.connect(decode.described, block_tokens=there)
    streamer.set_destination(
        "r", dest, dst_blocks[cached:], decode.expect("r"), cached_blocks=cached
    )
    for ready in (7, tokens):
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("r", ready)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("r", True)]
    landed, reason, _, _ = decode.wait("r")
    assert landed, reason
    return src_blocks, dst_blocks


@pytest.mark.parametrize("heads, planes", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("here, there", [(8, 4), (4, 8), (6, 4), (4, 6)])
@pytest.mark.parametrize("cached", [0, 1])
def test_each_token_lands_where_the_decode_sides_blocks_hold_it(here, there, heads, planes, cached):
    """A 15-token prompt from prefill blocks of `here` tokens into decode blocks of
    `there`, `cached` decode blocks of it cached there already; ready in two chunks (7
    tokens, then all 15); one or two heads, each one plane or two (vLLM's CPU cache: a
    head's K tokens, then its V tokens). Every token of every plane of every head of
    every layer lands in its place; the decode side's blocks before its prefix are not
    written."""
    tokens = 15
    decode = Decode(heads=heads, block_bytes=there * heads * planes * TOKEN_BYTES, planes=planes)
    streamer = transfer.KVStreamer(
        layout_of(source(here, heads, planes), heads, planes=planes), here
    )
    try:
        src_blocks, dst_blocks = stream(streamer, decode, here, there, tokens, cached)
        for layer in range(LAYERS):
            for cache in range(CACHES):
                for j, block in enumerate(dst_blocks):
                    got = np.array(decode.block(layer, cache, block), np.uint8)
                    got = got.reshape(heads * planes, there, TOKEN_BYTES)  # head-major
                    for t in range(there):
                        at = j * there + t  # the token of the prompt it holds
                        if at >= tokens:
                            continue  # past the prompt: the partial unit's rest, unread
                        for h in range(heads):
                            for p in range(planes):
                                want = (
                                    0
                                    if j < cached
                                    else value(
                                        layer,
                                        cache,
                                        src_blocks[at // here],
                                        heads * p + h,
                                        at % here,
                                    )
                                )
                                part = h * planes + p
                                assert (got[part, t] == want).all(), (layer, cache, block, h, p, t)
    finally:
        streamer.close()
        decode.close()


def assert_each_token_landed(
    decode, blocks, here: int, there: int, tokens: int, heads: int, order: str = "heads"
):
    """Every token of every head of every cache of every layer of the prompt stream() sent
    (its (source, destination) `blocks`, of `here` and `there` tokens) is in the decode
    side's block where its `order` keeps it (one plane a head)."""
    src_blocks, dst_blocks = blocks
    for layer in range(LAYERS):
        for cache in range(CACHES):
            for j, block in enumerate(dst_blocks):
                got = np.array(decode.block(layer, cache, block), np.uint8)
                if order == "heads":
                    got = got.reshape(heads, there, TOKEN_BYTES)
                else:
                    got = got.reshape(there, heads, TOKEN_BYTES).transpose(1, 0, 2)
                for t in range(min(there, tokens - j * there)):
                    at = j * there + t
                    for h in range(heads):
                        want = value(layer, cache, src_blocks[at // here], h, at % here)
                        assert (got[h, t] == want).all(), (layer, cache, block, h, t)


def token_major(caches: list[list[np.ndarray]], block_tokens: int, heads: int) -> list:
    """The same tokens as source()'s head-major caches, each block token-major (NHD)."""
    return [
        [
            np.ascontiguousarray(
                c.reshape(BLOCKS, heads, block_tokens, TOKEN_BYTES).transpose(0, 2, 1, 3)
            ).reshape(BLOCKS, -1)
            for c in row
        ]
        for row in caches
    ]


def in_blocks(caches: list[list[np.ndarray]], heads: int, order: str) -> transfer.CacheLayout:
    """The layout of `caches` with each layer's in one array, each block every cache's
    ([blocks, caches, ...]: K and V together block by block, as FlashInfer keeps them)."""
    arrays = [np.ascontiguousarray(np.stack(row, axis=1)) for row in caches]
    block = caches[0][0].shape[1]
    return transfer.CacheLayout(
        arrays,
        [
            [
                transfer.CacheSpec(
                    layer, c * block, CACHES * block, block, BLOCKS, heads, "", 1, order
                )
                for c in range(CACHES)
            ]
            for layer in range(LAYERS)
        ],
    )


@pytest.mark.parametrize("kv", ["apart", "blocks"])
@pytest.mark.parametrize("here_order, there_order", [("tokens", "heads"), ("heads", "tokens")])
@pytest.mark.parametrize("here, there", [(4, 4), (8, 4), (4, 6)])
def test_each_token_of_each_head_lands_where_the_other_order_keeps_it(
    here_order, there_order, here, there, kv
):
    """Prefill blocks token-major (NHD) and decode blocks head-major (HND), or the other
    way, of one block size or two, K and V in caches of their own or together block by
    block on both sides: a 15-token prompt of 3 heads, ready in two chunks, lands token by
    token, each head's bytes where the decode side's order keeps them."""
    heads, tokens = 3, 15
    decode = Decode(heads=heads, block_bytes=there * heads * TOKEN_BYTES, order=there_order, kv=kv)
    caches = source(here, heads)
    if here_order == "tokens":
        caches = token_major(caches, here, heads)
    layout = (
        in_blocks(caches, heads, here_order)
        if kv == "blocks"
        else layout_of(caches, heads, order=here_order)
    )
    streamer = transfer.KVStreamer(layout, here)
    try:
        blocks = stream(streamer, decode, here, there, tokens)
        assert_each_token_landed(decode, blocks, here, there, tokens, heads, there_order)
    finally:
        streamer.close()
        decode.close()


def test_caches_whose_tokens_are_not_the_same_bytes_are_refused_at_connect():
    """A decode side of blocks of 4 tokens: its block bytes must be 4 tokens of each head
    of the prefill side's token bytes; otherwise connect refuses, naming both sides."""
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(source(8, 2), heads=2), 8)
    try:
        for block_bytes, words in (
            (4 * 2 * TOKEN_BYTES * 2, "a token of a head is 4 bytes here (blocks of 8 tokens), 8"),
            (4 * 2 * TOKEN_BYTES + 2, "is not 2 head(s) of 1 plane(s) of 4 tokens each"),
        ):
            decode = Decode(heads=2, block_bytes=block_bytes)
            try:
                with pytest.raises(pdhal.InvalidArgumentError, match=re.escape(words)):
                    streamer.connect(decode.described, block_tokens=4)
            finally:
                decode.close()
    finally:
        streamer.close()


def test_unit_runs_coalesce_and_split_only_at_either_sides_block_ends():
    """Units of 2 tokens, blocks of 3 units here and 2 there, one head: a run of 6 units
    consecutive on both sides is 4 copies, split where a block ends on either side."""
    planner_layers = transfer.CacheLayout.from_caches(source(6, 1))
    dst = transfer.CacheLayout.from_caches(source(4, 1))
    planner = transfer.RunPlanner(planner_layers, dst.layers, (6, 4))
    assert (planner.unit_tokens, planner.units) == (2, (3, 2))
    base = planner_layers.regions[0][0]
    copies = planner.layer(0).copies([(0, 0, 6)])[:4]  # cache 0's
    unit = 2 * TOKEN_BYTES
    assert copies == [
        (base, 0, 0, 2 * unit),  # units 0-1: source block 0, destination block 0
        (base + 2 * unit, 0, 4 * TOKEN_BYTES, unit),  # unit 2: destination block 1 starts
        (base + 6 * TOKEN_BYTES, 0, 4 * TOKEN_BYTES + unit, unit),  # source block 1 starts
        (base + 6 * TOKEN_BYTES + unit, 0, 8 * TOKEN_BYTES, 2 * unit),
    ]


def test_a_prefix_shorter_on_the_decode_side_and_too_many_units_are_refused_naming_why():
    """The decode side's cached prefix (2 blocks of 4 tokens) shorter than add_request's
    (2 blocks of 6): the tokens between have no source block, said at set_destination.
    Blocks of 2^25 units against 1: refused at connect, not by every later post."""
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(source(6, 1)), 6)
    decode = Decode(heads=1, block_bytes=4 * TOKEN_BYTES)
    try:
        dest = streamer.connect(decode.described, block_tokens=4)
        streamer.add_request("r", [3, 4], 23, cached_blocks=2)
        with pytest.raises(
            pdhal.InvalidArgumentError,
            match="prefix \\(2 blocks of 4 tokens\\) "
            "is shorter than add_request's \\(2 blocks of 6\\)",
        ):
            streamer.set_destination("r", dest, [0, 1, 2, 3], decode.expect("r"), cached_blocks=2)
    finally:
        streamer.close()
    huge = transfer.KVStreamer(transfer.CacheLayout.from_caches(source(1, 1)), 1 << 25)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match="at most 16777216 units a block"):
            huge.connect(decode.described, block_tokens=1)
    finally:
        huge.close()
        decode.close()


def test_an_order_that_is_not_one_or_a_token_major_split_by_head_is_refused_naming_why():
    """CacheSpec.order is "heads" or "tokens", and a token-major block is one plane a
    head; a token-major cache split by head (a decode rank of another tensor-parallel
    split) is refused at connect: its heads are not one stretch of a block."""
    with pytest.raises(pdhal.InvalidArgumentError, match="CacheSpec.order must be one of"):
        transfer.CacheSpec(0, 0, 64, 64, 1, 2, "", 1, "nhd")
    with pytest.raises(pdhal.InvalidArgumentError, match="with order 'tokens'"):
        transfer.CacheSpec(0, 0, 64, 64, 1, 2, "", 2, "tokens")
    streamer = transfer.KVStreamer(layout_of(token_major(source(4, 2), 4, 2), 2, order="tokens"), 4)
    decode = Decode(heads=1, block_bytes=4 * TOKEN_BYTES)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match="are not one stretch of its blocks"):
            streamer.connect(decode.described, heads=transfer.HeadShard(1, 0, 1))
    finally:
        streamer.close()
        decode.close()


def together(caches: list[list[np.ndarray]], heads: int) -> list[np.ndarray]:
    """source()'s caches of each layer in one array, each head's part of every cache next
    to each other ([blocks, heads, caches, part]: K and V per head together)."""
    return [
        np.ascontiguousarray(np.stack([c.reshape(BLOCKS, heads, -1) for c in row], axis=2))
        for row in caches
    ]


def together_layout(arrays: list[np.ndarray], heads: int) -> transfer.CacheLayout:
    """The layout of together()'s arrays: each cache a spec, its heads CACHES parts apart."""
    part = arrays[0].shape[-1]
    block = heads * part  # one cache's bytes of a block
    return transfer.CacheLayout(
        arrays,
        [
            [
                transfer.CacheSpec(
                    layer,
                    cache * part,
                    CACHES * block,
                    block,
                    BLOCKS,
                    heads,
                    head_stride=CACHES * part,
                )
                for cache in range(CACHES)
            ]
            for layer in range(LAYERS)
        ],
    )


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("here, there", [(4, 4), (8, 4), (4, 6)])
@pytest.mark.parametrize(
    "prefill_kv, decode_kv",
    [
        ("apart", "together"),
        ("together", "apart"),
        ("together", "together"),
        ("blocks", "together"),
        ("together", "blocks"),
    ],
)
def test_each_head_of_k_and_v_lands_whether_a_side_keeps_them_apart_or_together(
    prefill_kv, decode_kv, here, there, heads
):
    """K and V in caches of their own on one side (FastDeploy's, vLLM's on GPUs), or
    together block by block ([blocks, 2, heads, ...]: FlashInfer's), and together head by
    head on the other ([blocks, heads, 2, tokens, dim]: CacheSpec head_stride), either way,
    or together head by head on both (whole blocks where their sizes are the same), of one
    block size or two: a 15-token prompt, ready in two chunks, lands each head's K and V
    tokens where the decode side keeps them (two layouts of a block of the same bytes in
    one region are no whole-block copy)."""
    tokens = 15
    decode = Decode(heads=heads, block_bytes=there * heads * TOKEN_BYTES, kv=decode_kv)
    caches = source(here, heads)
    layout = {
        "together": lambda: together_layout(together(caches, heads), heads),
        "blocks": lambda: in_blocks(caches, heads, "heads"),
        "apart": lambda: transfer.CacheLayout.from_caches(caches, heads=heads),
    }[prefill_kv]()
    streamer = transfer.KVStreamer(layout, here)
    try:
        blocks = stream(streamer, decode, here, there, tokens)
        assert_each_token_landed(decode, blocks, here, there, tokens, heads)
    finally:
        streamer.close()
        decode.close()


def test_heads_apart_pair_only_with_head_major_caches_of_as_many_heads():
    """A decode cache whose heads are apart against a prefill cache token-major, or of
    another head count: refused at connect, naming both, as is a description whose last
    head's part ends past its region; a spec whose heads overlap, are apart in a
    token-major block, or spill past its stride is refused when made."""
    decode = Decode(heads=2, block_bytes=4 * 2 * TOKEN_BYTES, kv="together")
    short = json.loads(json.dumps(decode.described))
    short["layout"]["layers"][0][1][1] += 1  # V a byte on: its last head's part ends past it
    refused = (
        (
            transfer.CacheLayout.from_caches(source(4, 2), heads=2),
            short,
            "cache 1 ends at byte 513",
        ),
        (
            layout_of(token_major(source(4, 2), 4, 2), 2, order="tokens"),
            decode.described,
            "'tokens' order",
        ),
        (transfer.CacheLayout.from_caches(source(8, 1)), decode.described, "here 1 head(s)"),
    )
    try:
        for layout, described, words in refused:
            streamer = transfer.KVStreamer(layout, 4)
            try:
                with pytest.raises(pdhal.InvalidArgumentError, match=re.escape(words)):
                    streamer.connect(described, block_tokens=4)
            finally:
                streamer.close()
    finally:
        decode.close()
    for spec, words in (
        (dict(block_bytes=64, heads=2, head_stride=16), "at least its 32 bytes"),
        (dict(block_bytes=32, heads=2, head_stride=32, order="tokens"), "with order 'tokens'"),
        (dict(block_bytes=32, heads=2, head_stride=64), "spans 80 bytes (heads 64 apart)"),
    ):
        with pytest.raises(pdhal.InvalidArgumentError, match=re.escape(words)):
            transfer.CacheSpec(0, 0, 64, blocks=1, **spec)


def test_a_shard_of_heads_apart_starts_at_its_first_heads_place():
    """Heads [1, 3) of 4 heads 2 parts apart (a decode rank of another tensor-parallel
    split): the view starts at head 1's part, keeps them apart, and its peer's words say
    so (the tenth word)."""
    spec = transfer.CacheSpec(0, 8, 256, 64, 2, 4, head_stride=32)
    view = spec.head_view(1, 2)
    assert (view.offset, view.block_bytes, view.heads, view.head_stride) == (40, 32, 2, 32)
    assert view.span == 48
    assert spec.head_view(3, 1) == transfer.CacheSpec(0, 8 + 96, 256, 16, 2, 1)
    assert spec.to_json() == [0, 8, 256, 64, 2, 4, "", 1, "heads", 32]
    assert transfer.CacheSpec.from_json(spec.to_json()) == spec


def test_caches_together_alike_on_both_sides_are_one_copy_per_run():
    """K and V together head by head on both sides, blocks of one size: a run of blocks is
    one copy of whole blocks, not one per head and cache; of two sizes, one per head,
    cache and stretch."""
    layout = together_layout(together(source(4, 2), 2), 2)
    base = layout.regions[0][0]
    alike = transfer.RunPlanner(layout, layout.layers, (4, 4))
    block = CACHES * 2 * 4 * TOKEN_BYTES
    assert alike.copies(0, [(1, 3, 2)]) == [(base + block, 0, 3 * block, 2 * block)]
    other = together_layout(together(source(8, 2), 2), 2)
    sizes = transfer.RunPlanner(layout, other.layers, (4, 8))
    # two units: two source blocks, one destination block; per stretch, head and cache
    assert len(sizes.copies(0, [(0, 0, 2)])) == 2 * 2 * CACHES
    part = 4 * TOKEN_BYTES  # a head's part of a block of 4 tokens
    # K, a gap, V per head: not whole blocks
    padded = [np.zeros((BLOCKS, 2, 3, part), np.uint8) for _ in range(LAYERS)]
    gap = transfer.CacheLayout(
        padded,
        [
            [
                transfer.CacheSpec(
                    layer, at * part, 6 * part, 2 * part, BLOCKS, 2, head_stride=3 * part
                )
                for at in (0, 2)
            ]
            for layer in range(LAYERS)
        ],
    )
    assert len(transfer.RunPlanner(gap, gap.layers, (4, 4)).copies(0, [(0, 0, 1)])) == 2 * CACHES


@pytest.mark.parametrize(
    "there, says", [(4, "1 plane(s) here, 2 on the peer"), (8, "of 1 plane(s) per block here")]
)
def test_caches_of_another_number_of_planes_are_refused_at_connect_naming_both(there, says):
    """A head's part of a block one plane here and two there (its K tokens, then its V
    tokens), blocks of one size or two: the bytes mean other tokens, refused at connect."""
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(source(4, 2), heads=2), 4)
    decode = Decode(heads=2, block_bytes=there * 2 * TOKEN_BYTES, planes=2)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match=re.escape(says)):
            streamer.connect(decode.described, block_tokens=there)
    finally:
        streamer.close()
        decode.close()
