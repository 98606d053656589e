"""A small decoder-only transformer in Paddle (CPU) that keeps its KV cache in paged blocks.

The model is deterministic: weights come from a seeded generator, so any process holding
the same `ModelConfig` computes bit-identical K and V for the same prompt chunks. That is
what lets the decode side verify every received byte against its own recomputation.

KV cache layout (one array for all layers): `[layers, 2 (K, V), blocks, heads, block_size,
head_dim]` float32, the per-layer `[blocks, heads, block_size, head_dim]` layout FastDeploy
uses, stacked. A request owns a list of block ids (its block table); token position p lives
in block `table[p // block_size]` at row `p % block_size`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 32
    hidden: int = 128
    heads: int = 4
    ffn: int = 512
    vocab: int = 512
    block_size: int = 64
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def cache_shape(self, blocks: int) -> tuple[int, ...]:
        return (self.layers, 2, blocks, self.heads, self.block_size, self.head_dim)

    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.heads * self.block_size * self.head_dim * 4


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
    unembedding to the next token."""

    def __init__(self, config: ModelConfig):
        import paddle

        self.paddle = paddle
        self.config = config
        rng = np.random.default_rng(config.seed)
        d, f = config.hidden, config.ffn
        # Residual branches scaled by 1/sqrt(2L) so that 32 layers do not drown the prompt in
        # one common direction (every prompt then predicted the same token).
        branch = 1.0 / math.sqrt(2 * config.layers)

        def weight(*shape, scale=1.0):
            return paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)
                                    * np.float32(scale / math.sqrt(shape[0])))

        self.embedding = weight(config.vocab, d)
        self.layers = [
            {name: weight(d, d) for name in ("wq", "wk", "wv")}
            | {"wo": weight(d, d, scale=branch), "w1": weight(d, f),
               "w2": weight(f, d, scale=branch)}
            for _ in range(config.layers)
        ]
        self.unembedding = weight(d, config.vocab)

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
        """Write this chunk's K and V into the cache, then attend over everything cached."""
        paddle, cfg = self.paddle, self.config
        n, h, hd = x.shape[0], cfg.heads, cfg.head_dim
        start, end = chunk.start, chunk.start + n
        blocks, rows = self._slots(end, chunk.block_table)
        k = paddle.matmul(x, weights["wk"]).reshape([n, h, hd])
        v = paddle.matmul(x, weights["wv"]).reshape([n, h, hd])
        cache[layer, 0, blocks[start:], :, rows[start:], :] = k.numpy()
        cache[layer, 1, blocks[start:], :, rows[start:], :] = v.numpy()
        keys = paddle.to_tensor(cache[layer, 0, blocks, :, rows, :]).transpose([1, 0, 2])
        values = paddle.to_tensor(cache[layer, 1, blocks, :, rows, :]).transpose([1, 0, 2])
        q = paddle.matmul(x, weights["wq"]).reshape([n, h, hd]).transpose([1, 0, 2])
        scores = paddle.matmul(q, keys, transpose_y=True) * (1.0 / math.sqrt(hd))
        future = np.arange(end)[None, :] > np.arange(start, end)[:, None]
        scores = scores + paddle.to_tensor(np.where(future, -1e9, 0.0).astype(np.float32))
        out = paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), values)
        return paddle.matmul(out.transpose([1, 0, 2]).reshape([n, cfg.hidden]), weights["wo"])

    def forward(self, chunks: Sequence[Chunk], cache: np.ndarray,
                after_layer: Callable[[int], None] | None = None) -> dict[int, int]:
        """Run one step over `chunks`, writing their K/V into `cache` layer by layer.

        `after_layer(i)` runs once layer i's K/V of every chunk is in the cache (where a
        worker posts its layer signal). Returns {request: next token} for chunks that end
        their prompt (or decode one token).
        """
        paddle = self.paddle
        hidden = [paddle.to_tensor(self.embedding.numpy()[np.asarray(c.tokens)])
                  + self._positions(c.start, len(c.tokens)) for c in chunks]
        for layer, weights in enumerate(self.layers):
            for i, chunk in enumerate(chunks):
                h = hidden[i]
                h = h + self._attend(layer, weights, self._rms(h), chunk, cache)
                up = paddle.nn.functional.silu(paddle.matmul(self._rms(h), weights["w1"]))
                hidden[i] = h + paddle.matmul(up, weights["w2"])
            if after_layer is not None:
                after_layer(layer)
        tokens = {}
        for chunk, h in zip(chunks, hidden):
            if chunk.last:
                logits = paddle.matmul(self._rms(h[-1:]), self.unembedding)
                tokens[chunk.request] = int(logits.argmax(axis=-1).item())
        return tokens
