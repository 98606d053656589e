"""The decode receiver: takes each request's blocks into its own cache, then checks them.

A request is inserted as a prefilled one (seq_lens_decoder = prompt length, encoder length
0, this-time 1, the first token from prefill). Once every request is in, the receiver
recomputes the prefill itself from the model's seeded weights and the same schedule, and
compares checksums of every block it received, then runs a few decode steps on the received
cache and on its own, which must give the same tokens.

With tensor parallelism it holds one cache per rank (`[tp, ...]`, as tp decode ranks would)
and computes every rank's part itself, summing them in the workers' order.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import numpy as np

from pdhal import ops
from pdhal_demo.model import Chunk, TinyDecoder
from pdhal_demo.plan import Plan
from pdhal_demo.transport import DecodeEndpoint


@dataclass
class DecodeSlot:
    """A request as the decode side's batch sees it."""

    request: int
    seq_lens_encoder: int  # 0: nothing left to prefill
    seq_lens_decoder: int  # tokens already in the cache
    seq_lens_this_time: int  # tokens to compute this step
    last_token: int
    block_table: list[int]

    @classmethod
    def prefilled(cls, request, first_token: int) -> DecodeSlot:
        return cls(request.id, 0, request.prompt_len, 1, first_token, request.decode_blocks)


def shards(cache: np.ndarray) -> dict[int, np.ndarray]:
    """{rank: that rank's cache} of a `[tp, ...]` decode cache."""
    return {rank: cache[rank] for rank in range(cache.shape[0])}


def decode(model: TinyDecoder, cache: np.ndarray, slots: list[DecodeSlot],
           steps: int) -> dict[int, list[int]]:
    """Generate `steps` tokens per slot, reading and extending `cache` (`[tp, ...]`)."""
    generated = {s.request: [s.last_token] for s in slots}
    for _ in range(steps):
        chunks = [Chunk(s.request, s.seq_lens_decoder, [s.last_token], s.block_table, True)
                  for s in slots]
        tokens = model.forward(chunks, shards(cache))
        for s in slots:
            s.seq_lens_decoder += s.seq_lens_this_time
            s.last_token = tokens[s.request]
            generated[s.request].append(s.last_token)
    return generated


def reference_prefill(model: TinyDecoder, plan: Plan, cache: np.ndarray) -> dict[int, int]:
    """The prefill the workers ran, step for step, into `cache` (`[tp, ...]`) at the decode
    block tables."""
    first_tokens, prompts = {}, plan.prompts()
    for step in plan.steps:
        first_tokens |= model.forward(plan.chunks(step, prompts, "decode"), shards(cache))
    return first_tokens


def _checksums(cache: np.ndarray, blocks: list[int]) -> list[int]:
    """crc32 of a request's blocks, per rank, layer and K/V."""
    return [zlib.crc32(np.ascontiguousarray(cache[rank, layer, kv, blocks]).data)
            for rank in range(cache.shape[0]) for layer in range(cache.shape[1])
            for kv in (0, 1)]


def verify(plan: Plan, cache: np.ndarray, first_tokens: dict[int, int]) -> dict:
    """Compare the received cache and the tokens decoded from it with a local recomputation."""
    model = TinyDecoder(plan.model, plan.tp)
    reference = np.zeros_like(cache)
    reference_first = reference_prefill(model, plan, reference)
    bad_blocks, checked_bytes = [], 0
    for request in plan.requests:
        blocks = request.decode_blocks[:len(request.prefill_blocks)]  # what prefill filled
        got, want = _checksums(cache, blocks), _checksums(reference, blocks)
        checked_bytes += cache[:, :, :, blocks].nbytes
        layers = plan.model.layers
        bad_blocks += [{"request": request.id, "rank": i // (2 * layers),
                        "layer": i // 2 % layers, "kv": "KV"[i % 2]}
                       for i, (g, w) in enumerate(zip(got, want)) if g != w]
    received = decode(model, cache, [DecodeSlot.prefilled(r, first_tokens[r.id])
                                     for r in plan.requests], plan.decode_steps)
    expected = decode(model, reference, [DecodeSlot.prefilled(r, reference_first[r.id])
                                         for r in plan.requests], plan.decode_steps)
    bad_tokens = [{"request": r, "got": received[r], "expected": expected[r]}
                  for r in expected if received[r] != expected[r]]
    return {"checked_bytes": checked_bytes, "bad_blocks": bad_blocks, "bad_tokens": bad_tokens,
            "tokens": {r: received[r] for r in received}}


def run(link, setup: dict) -> None:
    import paddle

    plan = Plan.from_json(setup["plan"])
    shape = (plan.tp, *plan.model.cache_shape(plan.decode_cache_blocks, plan.tp))
    buffer = ops.host_alloc(int(np.prod(shape)) * 4)
    cache = buffer.as_numpy(np.float32, shape)
    host = os.environ.get("PDHAL_DEMO_HOST", setup["host"])  # set when on another host
    endpoint = DecodeEndpoint(plan.transport, paddle.from_dlpack(cache), setup["cache_name"],
                              host, setup["protocol"])
    link.send(("ready", endpoint.describe()))
    first_tokens = {}
    while len(first_tokens) < len(plan.requests):
        kind, message = link.recv()  # ("request", ...): its blocks and first token are here
        if kind == "exit":  # the run failed elsewhere
            return
        first_tokens[message["request"]] = message["token"]
        link.send(("inserted", {"request": message["request"]}))
    # The check recomputes the whole prefill: start it only once the parent has timed every
    # insertion, so that it takes no core from a measurement still in flight.
    if link.recv()[0] == "exit":
        return
    link.send(("verified", verify(plan, cache, first_tokens)))
    link.recv()  # ("exit", {})
    ops.host_free(buffer)
