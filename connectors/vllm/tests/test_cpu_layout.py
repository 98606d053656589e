"""cpu_layout against vLLM's own CPU attention kernel: a prompt's K and V written into a
prefill cache of one block size by `cpu_attn_reshape_and_cache`, moved by pdhal.transfer
(KVStreamer to a KVReceiver over shm, both described by cpu_layout.layer_specs) into a
decode cache of another block size, equal byte for byte to the same K and V written by the
kernel straight into the decode cache's blocks. Per ISA whose packing cpu_layout knows
("amx" where this CPU has AMX tiles, "vec"), block sizes that divide each other either way
and that do not."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import vllm._custom_ops as vllm_ops
from pdhal_vllm.cpu_layout import attention_isa, layer_specs

import pdhal
from pdhal import ops, transfer

HEADS, HEAD_SIZE, BLOCKS, TOKENS = 2, 64, 6, 150  # 150: a partial last block on each side
ISAS = ["vec", *(["amx"] if torch.cpu._is_amx_tile_supported() else [])]


def kernel_cache(block_tokens: int, isa: str, dtype, kv=None, blocks: list[int] = ()):
    """A pdhal host buffer holding a [BLOCKS, HEADS, 2 x block_tokens, HEAD_SIZE] cache of
    `dtype`, zeros but for `kv` (key, value) written by vLLM's kernel into `blocks`; a
    numpy view of its bytes; its layout."""
    element = torch.tensor([], dtype=dtype).element_size()
    block = HEADS * 2 * block_tokens * HEAD_SIZE * element
    buffer = ops.host_alloc(BLOCKS * block)
    array = buffer.as_numpy(np.uint8, (BLOCKS * block,))
    array[:] = 0
    cache = torch.from_numpy(array).view(dtype).view(BLOCKS, HEADS, 2 * block_tokens, HEAD_SIZE)
    if kv is not None:
        slots = torch.tensor(
            [blocks[t // block_tokens] * block_tokens + t % block_tokens for t in range(TOKENS)]
        )
        k_cache, v_cache = cache.chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(*kv, k_cache, v_cache, slots, isa)
    specs, placed = layer_specs(
        isa, 0, block, BLOCKS, HEADS, block_tokens, HEAD_SIZE, element, "bfloat16"
    )
    assert placed
    return buffer, array, transfer.CacheLayout([buffer], [specs])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("here, there", [(32, 64), (64, 32), (64, 96)])
def test_tokens_land_where_vllm_s_kernel_packs_them_in_blocks_of_another_size(isa, here, there):
    dtype = torch.bfloat16
    assert attention_isa(dtype, 32, HEAD_SIZE, "auto") in ISAS  # (what vLLM picks here)
    os.environ.setdefault("PDHAL_NAMESPACE", f"cpulayout{os.getpid()}")
    generator = torch.Generator().manual_seed(here * 1000 + there)
    key = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=generator).to(dtype)
    value = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=generator).to(dtype)
    src_blocks = [4, 1, 3, 0, 5][: -(-TOKENS // here)]
    dst_blocks = [2, 5, 0, 3, 1][: -(-TOKENS // there)]
    owned = []
    try:
        source, _, source_layout = kernel_cache(here, isa, dtype, (key, value), src_blocks)
        owned.append(source)
        expected, want, _ = kernel_cache(there, isa, dtype, (key, value), dst_blocks)
        owned.append(expected)
        landed, got, decode_layout = kernel_cache(there, isa, dtype)
        owned.append(landed)
        receiver = transfer.KVReceiver(decode_layout, f"cpulayout-{isa}-{here}-{there}")
        streamer = transfer.KVStreamer(source_layout, here)
        try:
            dest = streamer.connect(receiver.describe(), block_tokens=there)
            streamer.add_request("r", src_blocks, TOKENS)
            streamer.set_destination("r", dest, dst_blocks, receiver.expect("r", 30))
            streamer.layer_ready(0, [("r", TOKENS)])
            assert receiver.wait("r").landed
        finally:
            streamer.close()
            receiver.close()
        assert np.array_equal(got, want), np.flatnonzero(got != want)[:8]
    finally:
        for buffer in owned:
            ops.host_free(buffer)


@pytest.mark.parametrize("here, there", [(32, 32), (32, 64)])
def test_blocks_packed_for_two_isas_are_refused_when_the_sides_pair(here, there):
    """A prefill packed for AMX tiles and a decode for "vec" (a host without them): their
    blocks keep a head's K in other planes, refused naming both, whatever their sizes."""

    def layout(isa: str, block_tokens: int) -> transfer.CacheLayout:
        block = HEADS * 2 * block_tokens * HEAD_SIZE * 2
        specs, _ = layer_specs(isa, 0, block, BLOCKS, HEADS, block_tokens, HEAD_SIZE, 2, "")
        return transfer.CacheLayout([np.zeros(BLOCKS * block, np.uint8)], [specs])

    said = r"1 plane\(s\) here, 64 on the peer|1 plane\(s\) per block here, 2 of 64 on the peer"
    with pytest.raises(pdhal.InvalidArgumentError, match=said):
        layout("amx", here).check_peer(layout("vec", there).describe(), tokens=(here, there))


def test_a_packing_not_known_here_is_one_spec_of_whole_blocks():
    """Another ISA, or an fp8 cache: one spec a layer, its tokens not placed (blocks then
    pair only with blocks of the same size)."""
    for isa, element in (("neon", 2), ("amx", 1)):
        specs, placed = layer_specs(isa, 64, 16384, BLOCKS, HEADS, 32, HEAD_SIZE, element, "")
        assert not placed
        assert specs == [
            transfer.CacheSpec(0, 64, 16384, 2 * HEADS * 32 * HEAD_SIZE * element, BLOCKS, HEADS)
        ]
