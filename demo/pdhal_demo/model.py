"""A small decoder-only transformer in Paddle (CPU) that keeps its KV cache in paged blocks.

The model is deterministic: weights come from a seeded generator, so any process holding
the same `ModelConfig` computes bit-identical K and V for the same prompt chunks. That is
what lets the decode side verify every received byte against its own recomputation.

KV cache layout (one array for all layers): `[layers, 2 (K, V), blocks, heads, block_size,
head_dim]` float32, the per-layer `[blocks, heads, block_size, head_dim]` layout FastDeploy
uses, stacked. A request owns a list of block ids (its block table); token position p lives
in block `table[p // block_size]` at row `p % block_size`.

Tensor parallelism (`tp` ranks): rank r owns heads [r * heads / tp, (r + 1) * heads / tp)
(its columns of wq, wk, wv and rows of wo) and its slice of the MLP's hidden units (columns
of w1, rows of w2), and its own cache holding only its heads. After attention and after the
MLP the ranks' partial outputs are summed in rank order (an all-reduce): a worker sums what
its peers sent, the decode side computes every rank's part itself and sums them the same
way, so both get the same bits. With tp=1 the one partial is the whole output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdhal import transfer


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 32
    hidden: int = 128
    heads: int = 4
    ffn: int = 512
    vocab: int = 512
    block_size: int = 64
    seed: int = 0
    #: How a cache block is ordered: "heads" (each head's tokens in order, [heads,
    #: block_size, head_dim]: HND) or "tokens" (each token's heads, [block_size, heads,
    #: head_dim]: NHD); pdhal.transfer converts between two sides' orders on the way.
    order: str = "heads"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def cache_shape(self, blocks: int, tp: int = 1) -> tuple[int, ...]:
        """One rank's cache: its heads only, each block in `order`."""
        inside = (self.heads // tp, self.block_size)
        if self.order == "tokens":
            inside = inside[::-1]
        return (self.layers, 2, blocks, *inside, self.head_dim)

    def slots(self, layer: int, kv: int, blocks, rows) -> tuple:
        """The index of the rows `rows` of blocks `blocks` (arrays) of one layer's K (kv 0)
        or V (1) in a cache of cache_shape: [tokens, heads, head_dim] whatever the order."""
        if self.order == "tokens":
            return (layer, kv, blocks, rows)
        return (layer, kv, blocks, slice(None), rows)

    def block_bytes(self, tp: int = 1) -> int:
        """Bytes of one block of one layer's K (or V), in one rank's cache."""
        return self.heads // tp * self.block_size * self.head_dim * 4

    def check_tp(self, tp: int) -> None:
        if tp < 1 or self.heads % tp or self.ffn % tp:
            raise ValueError(
                f"tp must divide the model's {self.heads} heads and {self.ffn} MLP units, got {tp}"
            )


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + len(tokens)) of one request, computed in one step."""

    request: int
    start: int
    tokens: Sequence[int]
    block_table: Sequence[int]
    last: bool  # the chunk ends the prompt: its final logits give the first token


def prompt_tokens(config: ModelConfig, request_seed: int, length: int) -> list[int]:
    """The deterministic prompt of a request."""
    rng = np.random.default_rng([config.seed, request_seed])
    return rng.integers(0, config.vocab, size=length).tolist()


class TinyDecoder:
    """RMSNorm → attention over the paged cache → RMSNorm → MLP, `layers` times, then an
    unembedding to the next token.

    `tp` ranks split the heads and MLP units; `ranks` are the ones this process computes
    (a prefill worker: its own; the decode side: all of them).
    """

    def __init__(self, config: ModelConfig, tp: int = 1, ranks: Sequence[int] | None = None):
        import paddle

        config.check_tp(tp)
        self.paddle = paddle
        self.config = config
        self.tp = tp
        self.ranks = list(range(tp)) if ranks is None else list(ranks)
        rng = np.random.default_rng(config.seed)
        d, f = config.hidden, config.ffn
        # Residual branches scaled by 1/sqrt(2L) so that 32 layers do not drown the prompt in
        # one common direction (every prompt then predicted the same token).
        branch = 1.0 / math.sqrt(2 * config.layers)

        def weight(*shape, scale=1.0):
            return paddle.to_tensor(
                rng.standard_normal(shape).astype(np.float32)
                * np.float32(scale / math.sqrt(shape[0]))
            )

        self.embedding = weight(config.vocab, d)
        self.layers = [
            {name: weight(d, d) for name in ("wq", "wk", "wv")}
            | {
                "wo": weight(d, d, scale=branch),
                "w1": weight(d, f),
                "w2": weight(f, d, scale=branch),
            }
            for _ in range(config.layers)
        ]
        self.unembedding = weight(d, config.vocab)
        self.shards = [{r: self._shard(layer, r) for r in self.ranks} for layer in self.layers]

    def _shard(self, w: dict, rank: int) -> dict:
        """Rank `rank`'s slices of one layer's weights (the whole weights when tp is 1)."""
        if self.tp == 1:
            return w
        cols = self.config.hidden // self.tp  # this rank's heads' columns
        units = self.config.ffn // self.tp
        c, u = slice(rank * cols, (rank + 1) * cols), slice(rank * units, (rank + 1) * units)
        return {
            "wq": w["wq"][:, c],
            "wk": w["wk"][:, c],
            "wv": w["wv"][:, c],
            "wo": w["wo"][c, :],
            "w1": w["w1"][:, u],
            "w2": w["w2"][u, :],
        }

    def _positions(self, start: int, count: int):
        d = self.config.hidden
        pos = np.arange(start, start + count, dtype=np.float32)[:, None]
        freq = np.exp(-np.log(10000.0) * np.arange(0, d, 2, dtype=np.float32) / d)[None, :]
        table = np.zeros((count, d), np.float32)
        table[:, 0::2] = np.sin(pos * freq)
        table[:, 1::2] = np.cos(pos * freq)
        return self.paddle.to_tensor(table)

    def _rms(self, x):
        return x * self.paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + 1e-6)

    def _slots(self, chunk_end: int, block_table: Sequence[int]):
        bs = self.config.block_size
        pos = np.arange(chunk_end)
        return np.asarray(block_table)[pos // bs], pos % bs

    def _attend(self, layer: int, weights, x, chunk: Chunk, cache: np.ndarray):
        """Write this chunk's K and V (of this rank's heads) into the rank's cache, attend
        over everything cached; this rank's part of the attention output."""
        paddle, cfg = self.paddle, self.config
        n, h, hd = x.shape[0], cfg.heads // self.tp, cfg.head_dim
        start, end = chunk.start, chunk.start + n
        blocks, rows = self._slots(end, chunk.block_table)
        k = paddle.matmul(x, weights["wk"]).reshape([n, h, hd])
        v = paddle.matmul(x, weights["wv"]).reshape([n, h, hd])
        cache[cfg.slots(layer, 0, blocks[start:], rows[start:])] = k.numpy()
        cache[cfg.slots(layer, 1, blocks[start:], rows[start:])] = v.numpy()
        keys = paddle.to_tensor(cache[cfg.slots(layer, 0, blocks, rows)]).transpose([1, 0, 2])
        values = paddle.to_tensor(cache[cfg.slots(layer, 1, blocks, rows)]).transpose([1, 0, 2])
        q = paddle.matmul(x, weights["wq"]).reshape([n, h, hd]).transpose([1, 0, 2])
        scores = paddle.matmul(q, keys, transpose_y=True) * (1.0 / math.sqrt(hd))
        future = np.arange(end)[None, :] > np.arange(start, end)[:, None]
        scores = scores + paddle.to_tensor(np.where(future, -1e9, 0.0).astype(np.float32))
        out = paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), values)
        return paddle.matmul(out.transpose([1, 0, 2]).reshape([n, h * hd]), weights["wo"])

    def _mlp(self, weights, x):
        up = self.paddle.nn.functional.silu(self.paddle.matmul(x, weights["w1"]))
        return self.paddle.matmul(up, weights["w2"])

    def reduce_local(self, parts: dict[int, list]) -> list:
        """Every rank's partial outputs (per chunk) computed here: their sum, in rank order."""
        out = list(parts[0])
        for rank in range(1, self.tp):
            out = [a + b for a, b in zip(out, parts[rank])]
        return out

    def forward(
        self,
        chunks: Sequence[Chunk],
        cache,
        after_layer: Callable[[int], None] | None = None,
        reduce: Callable[[dict[int, list]], list] | None = None,
    ) -> dict[int, int]:
        """Run one step over `chunks`, writing their K/V into the cache layer by layer.

        `cache` is the cache (tp=1) or {rank: that rank's cache} for the ranks computed
        here. `reduce` sums {rank: per-chunk partial outputs} into per-chunk outputs (default:
        every rank is computed here). `after_layer(i)` runs once layer i's K/V of every chunk
        is in the cache (where a worker posts its layer signal). Returns {request: next
        token} for chunks that end their prompt (or decode one token).
        """
        paddle = self.paddle
        caches = cache if isinstance(cache, dict) else {self.ranks[0]: cache}
        reduce = reduce or self.reduce_local
        hidden = [
            paddle.to_tensor(self.embedding.numpy()[np.asarray(c.tokens)])
            + self._positions(c.start, len(c.tokens))
            for c in chunks
        ]
        for layer, shards in enumerate(self.shards):
            normed = [self._rms(h) for h in hidden]
            attended = reduce(
                {
                    r: [
                        self._attend(layer, w, x, chunk, caches[r])
                        for x, chunk in zip(normed, chunks)
                    ]
                    for r, w in shards.items()
                }
            )
            hidden = [h + a for h, a in zip(hidden, attended)]
            normed = [self._rms(h) for h in hidden]
            mixed = reduce({r: [self._mlp(w, x) for x in normed] for r, w in shards.items()})
            hidden = [h + m for h, m in zip(hidden, mixed)]
            if after_layer is not None:
                after_layer(layer)
        tokens = {}
        for chunk, h in zip(chunks, hidden):
            if chunk.last:
                logits = paddle.matmul(self._rms(h[-1:]), self.unembedding)
                tokens[chunk.request] = int(logits.argmax(axis=-1).item())
        return tokens


def cache_layout(cache: np.ndarray, order: str = "heads") -> transfer.CacheLayout:
    """Where each block of a cache of ModelConfig.cache_shape is, for pdhal.transfer: one
    region (the cache), and per layer its K and V, each `blocks` blocks of one block's
    bytes, of the cache's element type (a peer of another is refused at the hello), a block
    its heads' parts, each its tokens in order (`order` "heads"), or its tokens' parts, each
    its heads' ("tokens"), so a decode side of another block size or order finds each token
    of each head."""
    layers, kv, blocks = cache.shape[:3]
    heads = cache.shape[3 if order == "heads" else 4]
    block = int(np.prod(cache.shape[3:])) * cache.itemsize
    return transfer.CacheLayout(
        [cache],
        [
            [
                transfer.CacheSpec(
                    region=0,
                    offset=(layer * kv + k) * blocks * block,
                    stride=block,
                    block_bytes=block,
                    blocks=blocks,
                    heads=heads,
                    dtype=cache.dtype.name,
                    order=order,
                )
                for k in range(kv)
            ]
            for layer in range(layers)
        ],
    )
