"""Device caches on the simulated cuda and xpu runtimes (no GPU or XPU here), for the
transfer tests that move them: the source caches in this process's device memory, a decode
process whose caches are its device memory, and a request streamed whole into it."""

from __future__ import annotations

import ctypes
import os

from pdhal_cuda.testing import CudaTestSupport
from pdhal_xpu.testing import XpuTestSupport

from pdhal import transfer
from pdhal.testing.transfer_peers import (
    BLOCK_BYTES,
    BLOCKS,
    CACHES,
    LAYERS,
    Decode,
    expected,
    landed_blocks,
    outcomes_until,
    source_caches,
)

#: The kind of memory each backend's device memory is.
KIND = {"cuda": "gpu", "xpu": "xpu"}
#: What the decode engine wrote in its caches before a transfer: no transfer touches it
#: outside the request's blocks (a staging mirror never held it).
ENGINE = 0xEE
#: The runtime function each backend's copies go through.
COPY = {"cuda": "cudaMemcpyAsync", "xpu": "xpu_memcpy_async"}


def on_device(
    backend: str,
    kv: str = "apart",
    env: dict | None = None,
    memory: str = "device",
    transport: str = "shm",
    name: str = "decode",
) -> Decode:
    """A decode process bound to `backend`'s simulated runtime, its caches device memory
    (`memory` "mixed": every other region host memory; "host": none), its receiver over
    `transport`, serving as `name`."""
    env = dict(
        os.environ,
        PDHAL_PLATFORM=backend,
        PDHAL_CUDART=CudaTestSupport.simulator(),
        PDHAL_XPURT=XpuTestSupport.simulator(),
        **(env or {}),
    )
    return Decode(name, transport, env=env, kv=kv, memory=memory)


def lands_alone(
    streamer, decode: Decode, src: list[int], dst: list[int], tokens: int, request: str = "a"
):
    """`request` (`tokens`, in source blocks `src`) streamed whole into a decode side's
    blocks `dst`: it lands, each block holds its source block's bytes, and every other
    block what the engine wrote there (ENGINE)."""
    ticket = decode.expect(request, blocks=dst)
    streamer.add_request(request, src, tokens)
    streamer.set_destination(request, streamer.connect(decode.described), dst, ticket)
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [(request, tokens)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome(request, True)]
    landed, reason, dump, uniform = decode.wait(request)
    assert landed and reason == "" and uniform
    for s, d in zip(src, dst):
        assert landed_blocks(dump, d) == expected(s), f"block {s} -> {d}"
    untouched = [b for b in range(BLOCKS) if b not in dst]
    assert all(landed_blocks(dump, b) == [[ENGINE] * CACHES] * LAYERS for b in untouched)


def device_sources(runtime) -> transfer.CacheLayout:
    """The source caches (transfer_peers.source_caches' bytes) in `runtime`'s device memory,
    each cache a region."""
    regions, specs = [], []
    for row in source_caches():
        specs.append([])
        for cache in row:
            region = runtime.device.alloc(cache.nbytes)
            ctypes.memmove(region.data_ptr(), cache.ctypes.data, cache.nbytes)
            specs[-1].append(transfer.CacheSpec(len(regions), 0, BLOCK_BYTES, BLOCK_BYTES, BLOCKS))
            regions.append(region)
    return transfer.CacheLayout(regions, specs)
