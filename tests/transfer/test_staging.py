"""A decode side whose caches are device memory its transport cannot reach (simulated cuda
and xpu runtimes: no GPU or XPU here; shm moves host memory only): its receiver serves a
pinned host mirror of them and copies each request's blocks into them through the
runtime before it reports the request landed (each layer before layers_landed counts it).
Real processes: this one prefills on the cpu backend, the decode process is bound to the
simulated runtime. No other block of the caches changes; a copy the runtime fails fails
the request with why."""

from __future__ import annotations

import os

import pytest
from pdhal_cuda.testing import CudaTestSupport
from pdhal_xpu.testing import XpuTestSupport

from pdhal import transfer
from pdhal.testing.transfer_peers import (
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

#: The kind of memory each backend's device memory is.
KIND = {"cuda": "gpu", "xpu": "xpu"}
#: What the decode engine wrote in its caches before a transfer: no transfer touches it
#: outside the request's blocks (the mirror never held it).
ENGINE = 0xEE
#: The runtime function each backend's copies go through.
COPY = {"cuda": "cudaMemcpyAsync", "xpu": "xpu_memcpy_async"}


def on_device(backend: str, kv: str = "apart", env: dict | None = None) -> Decode:
    """A decode process bound to `backend`'s simulated runtime, its caches device memory."""
    env = dict(
        os.environ,
        PDHAL_PLATFORM=backend,
        PDHAL_CUDART=CudaTestSupport.simulator(),
        PDHAL_XPURT=XpuTestSupport.simulator(),
        **(env or {}),
    )
    return Decode(env=env, kv=kv, memory="device")


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
        ticket = decode.expect("a", blocks=[5, 6, 0])
        streamer.add_request("a", [2, 3, 4], 10)
        streamer.set_destination("a", streamer.connect(decode.described), [5, 6, 0], ticket)
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 10)])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
        landed, reason, dump, uniform = decode.wait("a")
        assert landed and reason == "" and uniform
        for src, dst in zip([2, 3, 4], [5, 6, 0]):
            assert landed_blocks(dump, dst) == expected(src), f"block {src} -> {dst}"
        untouched = [b for b in range(BLOCKS) if b not in (5, 6, 0)]
        assert all(landed_blocks(dump, b) == [[ENGINE] * CACHES] * LAYERS for b in untouched)
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
        count, dump = decode.layers("a")
        while count < 1:
            count, dump = decode.layers("a")
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
