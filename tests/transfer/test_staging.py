"""A decode side whose caches are device memory its transport cannot reach (simulated cuda
and xpu runtimes: no GPU or XPU here; shm moves host memory only): its receiver serves a
pinned host mirror of them and copies each request's blocks into them through the
runtime before it reports the request landed (each layer before layers_landed counts it).
Real processes: this one prefills on the cpu backend, the decode process is bound to the
simulated runtime. No other block of the caches changes; a copy the runtime fails fails
the request with why."""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest
from device_peers import COPY, ENGINE, KIND, device_sources, lands_alone, on_device

from pdhal import InvalidArgumentError, transfer
from pdhal._transfer.staging import stretches
from pdhal.testing import session_peers
from pdhal.testing.transfer_peers import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    BLOCKS,
    CACHES,
    LAYERS,
    Decode,
    expected,
    landed_blocks,
    layers_until,
    outcomes_until,
    source_caches,
)

pytestmark = pytest.mark.simulated


def counted(decode: Decode, request_id: str, bound: float = 30.0):
    """decode.layers(request_id) once it counts a layer (or fails), within `bound` s."""
    deadline = time.monotonic() + bound
    while (got := decode.layers(request_id))[0] == 0:
        assert time.monotonic() < deadline, f"no layer of {request_id} counted in {bound} s"
        time.sleep(0.002)
    return got


@pytest.fixture
def streamer():
    s = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, claim_timeout=30
    )
    yield s
    s.close()


@pytest.mark.parametrize("backend", ["cuda", "xpu"])
@pytest.mark.parametrize("kv", ["apart", "blocks", "halves", "layers"])
def test_device_caches_are_staged_and_hold_every_block_once_it_is_reported_landed(
    streamer, backend, kv
):
    """Every block of the request is in the caches; every other block holds what the
    engine wrote there (ENGINE), which the mirror never held."""
    decode = on_device(backend, kv)
    try:
        decode.fill(ENGINE)
        regions = len(decode.described["layout"]["regions"])
        assert decode.described["staged"] == [KIND[backend]] * regions
        assert decode.described["layout"]["memory"] == ["cpu"] * regions  # what shm serves
        lands_alone(streamer, decode, [2, 3, 4], [5, 6, 0], 10)
    finally:
        decode.close()


@pytest.mark.parametrize("backend", ["cuda", "xpu"])
def test_a_layerwise_request_s_layers_are_in_the_device_caches_as_they_are_counted(
    streamer, backend
):
    """layers_landed counts a layer only once it is copied into the caches; the layers
    not counted yet hold what the engine wrote (nothing is copied ahead of its landing,
    nor past a layer's own bytes: here each block holds every layer)."""
    decode = on_device(backend, "layers")
    try:
        decode.fill(ENGINE)
        ticket = decode.expect("a", layerwise=True, blocks=[1, 7])
        streamer.add_request("a", [3, 4], 8)
        streamer.set_destination("a", streamer.connect(decode.described), [1, 7], ticket)
        streamer.layer_ready(0, [("a", 8)])
        layers_until(streamer, 1)
        count, dump = counted(decode, "a")
        assert count == 1
        for src, dst in zip([3, 4], [1, 7]):
            assert landed_blocks(dump, dst)[0] == expected(src)[0]
            assert landed_blocks(dump, dst)[1:] == [[ENGINE] * CACHES] * (LAYERS - 1)
        for layer in range(1, LAYERS):
            streamer.layer_ready(layer, [("a", 8)])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
        landed, _, dump, _ = decode.wait("a")
        assert landed
        for src, dst in zip([3, 4], [1, 7]):
            assert landed_blocks(dump, dst) == expected(src)
        untouched = [b for b in range(BLOCKS) if b not in (1, 7)]
        assert all(landed_blocks(dump, b) == [[ENGINE] * CACHES] * LAYERS for b in untouched)
    finally:
        decode.close()


def test_a_staged_receiver_needs_each_request_s_blocks(streamer):
    decode = on_device("xpu")
    try:
        refused = decode.expect("a")
        assert "InvalidArgumentError" in refused["error"]
        assert "stages its xpu caches through pinned host memory" in refused["error"]
        assert "needs the request's blocks" in refused["error"]
        assert "InvalidArgumentError" in decode.expect("b", blocks=[BLOCKS])["error"]
    finally:
        decode.close()


@pytest.mark.parametrize("backend", ["cuda", "xpu"])
def test_a_copy_into_the_caches_the_runtime_fails_fails_the_request_with_why(streamer, backend):
    """The data landed in the mirror, but the runtime refused to copy it into the caches:
    the request is failed (never reported landed), naming the copy, its blocks free."""
    decode = on_device(backend, env={"SIM_FAIL": COPY[backend]})
    try:
        ticket = decode.expect("a", blocks=[2])
        streamer.add_request("a", [5], 4)
        streamer.set_destination("a", streamer.connect(decode.described), [2], ticket)
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]  # it wrote it all
        landed, reason, free = decode.outcome("a")
        assert not landed and free
        assert "copying its blocks from pinned host memory into the caches failed" in reason
    finally:
        decode.close()


@pytest.mark.parametrize("backend", ["cuda", "xpu"])
def test_a_prefill_side_s_device_caches_are_staged_each_layer_as_it_goes(bind, backend):
    """This process prefills into the simulated runtime's device memory; its streamer sends
    from a pinned host mirror, each layer's blocks copied into it as they go (a partial
    last block once the prompt is whole), to a decode process on the cpu backend."""
    streamer = transfer.KVStreamer(device_sources(bind(backend)), BLOCK_TOKENS, claim_timeout=30)
    decode = Decode(env=dict(os.environ, PDHAL_PLATFORM="cpu"))
    try:
        ticket = decode.expect("a")
        streamer.add_request("a", [2, 3, 4], 10)
        streamer.set_destination("a", streamer.connect(decode.described), [5, 6, 0], ticket)
        for tokens in (6, 10):  # chunked: the partial block goes with the second chunk
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [("a", tokens)])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
        landed, reason, dump, uniform = decode.wait("a")
        assert landed and reason == "" and uniform
        for src, dst in zip([2, 3, 4], [5, 6, 0]):
            assert landed_blocks(dump, dst) == expected(src), f"block {src} -> {dst}"
    finally:
        decode.close()
        streamer.close()


def test_a_copy_out_of_the_caches_the_runtime_fails_fails_the_request_with_why(bind):
    runtime = bind("xpu")
    streamer = transfer.KVStreamer(device_sources(runtime), BLOCK_TOKENS, claim_timeout=30)
    decode = Decode(env=dict(os.environ, PDHAL_PLATFORM="cpu"))
    try:
        ticket = decode.expect("a")
        streamer.add_request("a", [2], 4)
        streamer.set_destination("a", streamer.connect(decode.described), [5], ticket)
        runtime.fail(COPY["xpu"])
        try:
            streamer.layer_ready(0, [("a", 4)])
        finally:
            runtime.clear_failures()
        [outcome] = outcomes_until(streamer, 1)
        assert not outcome.landed
        assert "copying its blocks from the caches into pinned host memory failed" in (
            outcome.reason
        )
        landed, reason, _ = decode.outcome("a")
        assert not landed and "into pinned host memory failed" in reason
    finally:
        decode.close()
        streamer.close()


def test_a_claim_through_a_session_lands_in_staged_device_caches(bind):
    """The control plane over a staged decode side: this process's DecodeClient (bound to
    the simulated xpu runtime, its caches device memory) claims from a prefill service in
    a process on the cpu backend; what it reports landed is in its device caches, head by
    head, and nothing else of them changed."""
    runtime = bind("xpu")
    block = session_peers.KV_HEADS * session_peers.HEAD_BYTES
    regions = [
        runtime.device.alloc(session_peers.BLOCKS * block)
        for _ in range(session_peers.LAYERS * session_peers.CACHES)
    ]
    for region in regions:
        ctypes.memset(region.data_ptr(), ENGINE, region.nbytes)
    layout = transfer.CacheLayout(
        regions,
        [
            [
                transfer.CacheSpec(
                    layer * session_peers.CACHES + c,
                    0,
                    block,
                    block,
                    session_peers.BLOCKS,
                    session_peers.KV_HEADS,
                )
                for c in range(session_peers.CACHES)
            ]
            for layer in range(session_peers.LAYERS)
        ],
    )
    service = session_peers.Peer("prefill", env=dict(os.environ, PDHAL_PLATFORM="cpu"))
    receiver = transfer.KVReceiver(layout, f"staged-session-{os.getpid()}", slots=4)
    client = transfer.DecodeClient(
        receiver,
        key=session_peers.KEY,
        kv_heads=session_peers.KV_HEADS,
        block_tokens=session_peers.BLOCK_TOKENS,
    )
    try:
        [address] = service.read("listening")
        client.claim("r1", address, [5, 2], tokens=8, timeout=30)
        service.send("add", "r1", [1, 3], 8)
        got = []
        while not got:
            got = client.poll(timeout=30)
        assert [(o.request_id, o.landed) for o in got] == [("r1", True)], got
        for index, region in enumerate(regions):
            layer, cache = divmod(index, session_peers.CACHES)
            data = ctypes.string_at(region.data_ptr(), region.nbytes)
            for b in range(session_peers.BLOCKS):
                src = {5: 1, 2: 3}.get(b)
                for head in range(session_peers.KV_HEADS):
                    start = b * block + head * session_peers.HEAD_BYTES
                    want = ENGINE if src is None else session_peers.value(layer, cache, src, head)
                    assert set(data[start : start + session_peers.HEAD_BYTES]) == {want}, (
                        layer,
                        cache,
                        b,
                        head,
                    )
    finally:
        client.close()
        receiver.close()
        service.close()


@pytest.mark.parametrize(
    "prefill, decode, transport",
    [("cuda", "xpu", "shm"), ("xpu", "cuda", "shm"), ("cuda", "xpu", "mooncake")],
)
def test_one_vendor_s_device_caches_reach_another_s_through_pinned_host_memory(
    bind, prefill, decode, transport
):
    """Prefill on one simulated runtime's device memory, decode on the other's, on one
    host over shm, or over Mooncake's TCP (whose CPU reads and writes host memory only):
    each side stages its own (no IPC handle of either vendor leaves its process), and every
    block is in the decode side's device memory once it landed."""
    streamer = transfer.KVStreamer(
        device_sources(bind(prefill)), BLOCK_TOKENS, claim_timeout=30, transport_name=transport
    )
    there = on_device(decode, "halves", transport=transport)
    try:
        assert there.described["staged"]  # the decode side's device caches
        there.fill(ENGINE)
        lands_alone(streamer, there, [0, 6], [7, 1], 8)
    finally:
        there.close()
        streamer.close()


@pytest.mark.parametrize("backend", ["cuda", "xpu"])
def test_a_staged_prefill_copies_whole_source_blocks_to_a_decode_side_of_smaller_blocks(
    bind, backend
):
    """Blocks of 4 tokens here, of 2 there: each of this side's blocks goes as two units,
    and what is staged is the source blocks that hold them (not the units' ids)."""
    streamer = transfer.KVStreamer(device_sources(bind(backend)), BLOCK_TOKENS, claim_timeout=30)
    decode = Decode(env=dict(os.environ, PDHAL_PLATFORM="cpu"), block_bytes=BLOCK_BYTES // 2)
    try:
        ticket = decode.expect("a")
        dest = streamer.connect(decode.described, block_tokens=BLOCK_TOKENS // 2)
        streamer.add_request("a", [1, 2], 8)
        streamer.set_destination("a", dest, [6, 0, 3, 5], ticket)
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 8)])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
        landed, reason, dump, uniform = decode.wait("a")
        assert landed and reason == "" and uniform
        for src, dst in zip([1, 1, 2, 2], [6, 0, 3, 5]):
            assert landed_blocks(dump, dst) == expected(src), f"block {src} -> {dst}"
    finally:
        decode.close()
        streamer.close()


@pytest.mark.parametrize("backend", ["cuda", "xpu"])
def test_device_and_host_caches_in_one_layout_stage_the_device_ones_only(streamer, backend):
    """A host region is served as it is (the xpu runtime copies no host memory to host
    memory: staging it would fail every request); the device ones go through the mirror."""
    decode = on_device(backend, memory="mixed")
    try:
        decode.fill(ENGINE)
        regions = len(decode.described["layout"]["regions"])
        assert decode.described["staged"] == [KIND[backend], "cpu"] * (regions // 2)
        lands_alone(streamer, decode, [6, 1], [4, 3], 8)
    finally:
        decode.close()


def test_other_blocks_than_the_receiver_expects_are_refused_at_set_destination(streamer):
    """A staging receiver copies the blocks expect() was given; the prefill side refuses
    other destination blocks, at the call that gives them (else the request's bytes would
    stay in the mirror and another block's be copied over)."""
    decode = on_device("xpu")
    try:
        ticket = decode.expect("a", blocks=[1])
        streamer.add_request("a", [2], 4)
        dest = streamer.connect(decode.described)
        with pytest.raises(InvalidArgumentError, match="not the blocks its decode side's"):
            streamer.set_destination("a", dest, [5], ticket)
        streamer.set_destination("a", dest, [1], ticket)
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        assert decode.wait("a")[0]
    finally:
        decode.close()


def test_a_layer_copy_the_runtime_fails_fails_the_request_its_blocks_held(streamer):
    """layers_landed raises TransferError once a layer's copy failed, and the request is
    failed for good (reported so, its blocks held: its prefill side may still write the
    mirror), not counted on as if nothing happened."""
    decode = on_device("xpu", "blocks", env={"SIM_FAIL": COPY["xpu"] + ":1"})
    try:
        ticket = decode.expect("a", layerwise=True, blocks=[1, 7])
        streamer.add_request("a", [3, 4], 8)
        streamer.set_destination("a", streamer.connect(decode.described), [1, 7], ticket)
        streamer.layer_ready(0, [("a", 8)])
        layers_until(streamer, 1)
        count, said = counted(decode, "a")  # (the copy is tried once the layer counts)
        assert count is None and "TransferError" in said and "copying its blocks" in said
        landed, reason, free = decode.outcome("a")
        assert not landed and not free and "copying its blocks" in reason
    finally:
        decode.close()


def test_a_stretch_never_spans_a_gap_that_holds_another_block_s_bytes():
    """Caches whose heads are apart (head_stride) copy head by head where nothing of the
    same block fills between them: here B's block b - 1 lies inside A's block b's span,
    and one layer's heads sit between another layer's. Pieces that touch still merge."""
    p = 16
    region = np.zeros(4 * p * 9, np.uint8)
    a = transfer.CacheSpec(0, 0, 4 * p, 2 * p, 8, 2, head_stride=2 * p)
    b = transfer.CacheSpec(0, 5 * p, 4 * p, 2 * p, 8, 2, head_stride=2 * p)
    got = stretches(transfer.CacheLayout([region], [[a, b]]), range(1))
    assert sorted((s.offset, s.width) for s in got) == [(0, p), (2 * p, p), (5 * p, p), (7 * p, p)]
    # [blocks, heads, layers, part]: layer 1's heads are between layer 0's
    heads = [
        transfer.CacheSpec(0, layer * p, 4 * p, 2 * p, 8, 2, head_stride=2 * p) for layer in (0, 1)
    ]
    layout = transfer.CacheLayout([region], [[heads[0]], [heads[1]]])
    assert sorted((s.offset, s.width) for s in stretches(layout, range(1, 2))) == [
        (p, p),
        (3 * p, p),
    ]
    whole = stretches(layout, range(2))  # every layer: the heads touch, one stretch a block
    assert [(s.offset, s.width, s.stride) for s in whole] == [(0, 4 * p, 4 * p)]
