"""The decode receiver: takes each request's blocks into its own cache, then checks them.

A request is inserted as a prefilled one (seq_lens_decoder = prompt length, encoder length
0, this-time 1, the first token from prefill). The receiver recomputes each request's
prefill itself from the model's seeded weights and the same chunks, compares checksums of
every prompt token's K/V it received, then runs a few decode steps on the received cache and
on its own, which must give the same tokens: once every request is in (and timed), or, when
blocks are recycled, each request as it arrives, releasing its blocks after.

With tensor parallelism it holds one cache per rank (`[tp, ...]`, as tp decode ranks would)
and computes every rank's part itself, summing them in the workers' order.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass

import numpy as np

import pdhal
from pdhal import ops, transfer
from pdhal_demo.control import DemoError, configure_transport
from pdhal_demo.model import Chunk, TinyDecoder, cache_layout
from pdhal_demo.plan import Plan

#: How long a request it claims may take to land: the whole run's bound.
LOAD_TIMEOUT_S = 600.0
#: The control session's liveness bound: a messager silent this long has gone.
KEEPALIVE_S = 5.0


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


def decode(
    model: TinyDecoder, cache: np.ndarray, slots: list[DecodeSlot], steps: int
) -> dict[int, list[int]]:
    """Generate `steps` tokens per slot, reading and extending `cache` (`[tp, ...]`)."""
    generated = {s.request: [s.last_token] for s in slots}
    for _ in range(steps):
        chunks = [
            Chunk(s.request, s.seq_lens_decoder, [s.last_token], s.block_table, True) for s in slots
        ]
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


def _checksums(model, cache: np.ndarray, blocks: list[int], tokens: int) -> list[int]:
    """crc32 of the rows of a request's `tokens` prompt tokens in its blocks (of `model`'s
    block size and order), per rank, layer and K/V. (The rest of its last block is whatever
    the block held before: blocks are recycled, and an engine writes only the rows of
    tokens.)"""
    full, tail = divmod(tokens, model.block_size)
    rows = np.arange(tail)
    out = []
    for rank in range(cache.shape[0]):
        for layer in range(cache.shape[1]):
            for kv in (0, 1):
                crc = zlib.crc32(np.ascontiguousarray(cache[rank, layer, kv, blocks[:full]]).data)
                if tail:
                    part = cache[rank][model.slots(layer, kv, np.full(tail, blocks[full]), rows)]
                    crc = zlib.crc32(np.ascontiguousarray(part).data, crc)
                out.append(crc)
    return out


class Checker:
    """Checks requests one at a time against a recomputation of each request's chunks in the
    order the workers computed them (a request's K/V depend on its own chunks only): every
    received block's checksum, then a few decode steps on the received cache and on the
    recomputed one, which must give the same tokens."""

    def __init__(self, plan: Plan, cache: np.ndarray):
        self.plan, self.cache = plan, cache
        self.model = TinyDecoder(plan.decode_model, plan.tp)
        self.reference = np.zeros_like(cache)  # scratch: each request's own blocks only
        self.prompts = plan.prompts()
        self.checked_bytes, self.bad_blocks, self.bad_tokens, self.tokens = 0, [], [], {}

    def check(self, request_id: int, first_token: int) -> None:
        plan, request, layers = self.plan, self.plan.request(request_id), self.plan.model.layers
        reference_first = None
        for c in plan.chunks_of(request_id):
            reference_first = self.model.forward(
                plan.chunks([c], self.prompts, "decode"), shards(self.reference)
            ).get(request_id)
        blocks = plan.decode_prompt_blocks(request_id)  # what prefill filled
        got = _checksums(plan.decode_model, self.cache, blocks, request.prompt_len)
        want = _checksums(plan.decode_model, self.reference, blocks, request.prompt_len)
        # K and V of every prompt token, every layer, every rank's heads
        self.checked_bytes += (
            2 * layers * request.prompt_len * (plan.model.block_bytes() // plan.model.block_size)
        )
        self.bad_blocks += [
            {
                "request": request_id,
                "rank": i // (2 * layers),
                "layer": i // 2 % layers,
                "kv": "KV"[i % 2],
            }
            for i, (g, w) in enumerate(zip(got, want))
            if g != w
        ]
        received = decode(
            self.model, self.cache, [DecodeSlot.prefilled(request, first_token)], plan.decode_steps
        )[request_id]
        expected = decode(
            self.model,
            self.reference,
            [DecodeSlot.prefilled(request, reference_first)],
            plan.decode_steps,
        )[request_id]
        if received != expected:
            self.bad_tokens.append({"request": request_id, "got": received, "expected": expected})
        self.tokens[request_id] = received

    def result(self) -> dict:
        return {
            "checked_bytes": self.checked_bytes,
            "bad_blocks": self.bad_blocks,
            "bad_tokens": self.bad_tokens,
            "tokens": self.tokens,
        }


def verify(plan: Plan, cache: np.ndarray, first_tokens: dict[int, int]) -> dict:
    """Check every request of `plan` in the received `cache` (see Checker)."""
    checker = Checker(plan, cache)
    for request in plan.requests:
        checker.check(request.id, first_tokens[request.id])
    return checker.result()


def _receivers(plan: Plan, cache: np.ndarray, name: str) -> list[transfer.KVReceiver]:
    """A KVReceiver per rank, over that rank's cache (as tp decode ranks would have)."""
    receivers = []
    for rank in range(plan.tp):
        receivers.append(
            transfer.KVReceiver(
                cache_layout(cache[rank], plan.decode_order),
                f"{name}.{rank}",
                transport_name=plan.transport,
                slots=max(len(plan.requests), 1),
            )
        )
    return receivers


class Claims:
    """The decode ranks' sessions with the messagers: each request claimed into its decode
    blocks once the requests whose blocks it reuses were checked and released, and its
    outcome on every rank."""

    def __init__(self, plan: Plan, receivers: list[transfer.KVReceiver], key: bytes):
        self.plan = plan
        self.clients = [
            transfer.DecodeClient(
                receiver,
                key=key,
                block_tokens=plan.decode_block_size,
                tp_rank=rank,
                tp_size=plan.tp,
                keepalive=KEEPALIVE_S,
            )
            for rank, receiver in enumerate(receivers)
        ]
        self.prefill: list[str] = []  # each messager's address, by rank
        self.claimed: set[int] = set()
        self.released: set[int] = set()
        self.ended: list[dict[str, transfer.Outcome]] = [{} for _ in self.clients]

    def claim_free(self) -> None:
        """Claim every request whose decode blocks are free (its waits released)."""
        for request in self.plan.requests:
            if request.id in self.claimed or not self.released.issuperset(request.decode_waits):
                continue
            self.claimed.add(request.id)
            blocks = self.plan.decode_prompt_blocks(request.id)
            for client in self.clients:
                client.claim(
                    str(request.id),
                    self.prefill,
                    blocks,
                    tokens=request.prompt_len,
                    timeout=LOAD_TIMEOUT_S,
                )

    def release(self, request: int) -> None:
        self.released.add(request)
        self.claim_free()

    def await_landed(self, request: int) -> None:
        """Every rank's blocks of `request` are in (its messagers said so): the decode
        side's own outcomes must agree, or nothing is decoded on what may be a partial
        cache."""
        rid, deadline = str(request), time.monotonic() + LOAD_TIMEOUT_S
        for rank, client in enumerate(self.clients):
            while rid not in self.ended[rank]:
                left = deadline - time.monotonic()
                if left <= 0:  # (the claim's own timeout ends it first)
                    raise DemoError(f"request {request} did not end on rank {rank}")
                self.ended[rank].update((o.request_id, o) for o in client.poll(timeout=left))
            outcome = self.ended[rank].pop(rid)
            if not outcome.landed:
                raise DemoError(f"request {request} did not land on rank {rank}: {outcome.reason}")

    def close(self) -> None:
        for client in self.clients:
            client.close()


def run(link, setup: dict) -> None:
    """Claim every request whose blocks are free from the messagers (once the parent says
    where they are), then insert each as it comes, once its outcomes say it landed. When
    blocks are recycled, check each request at once and release its blocks (the requests
    that reuse them are claimed then); otherwise check them all once the parent has timed
    every insertion, so the recomputation takes no core from a measurement still in
    flight."""
    plan = Plan.from_json(setup["plan"])
    shape = (plan.tp, *plan.decode_model.cache_shape(plan.decode_cache_blocks, plan.tp))
    buffer = ops.host_alloc(int(np.prod(shape)) * 4)
    cache = buffer.as_numpy(np.float32, shape)
    # this host's address: PDHAL_DEMO_HOST is set when the decoder is on another host
    host = os.environ.get("PDHAL_DEMO_HOST", setup["host"])
    configure_transport(plan.transport, host, setup["protocol"])
    receivers = _receivers(plan, cache, setup["cache_name"])
    claims = Claims(plan, receivers, bytes.fromhex(setup["session_key"]))
    link.send(("ready", {"backend": pdhal.current_backend()}))  # the platform it runs on
    kind, message = link.recv()  # ("serve", ...): the messagers' addresses
    if kind == "exit":  # the run failed elsewhere
        return
    claims.prefill = message["prefill"]
    for client in claims.clients:  # every session made (and the hellos checked) first, so
        client.connect(claims.prefill)  # that "claimed" means each claim went
    claims.claim_free()
    link.send(("claimed", {}))
    checker, recycles = Checker(plan, cache), plan.recycles
    first_tokens = {}
    while len(first_tokens) < len(plan.requests):
        kind, message = link.recv()  # ("request", ...): its blocks and first token are here
        if kind == "exit":  # the run failed elsewhere
            return
        request = message["request"]
        claims.await_landed(request)
        first_tokens[request] = message["token"]
        link.send(("inserted", {"request": request}))
        if recycles:
            checker.check(request, message["token"])
            claims.release(request)
    if link.recv()[0] == "exit":  # ("verify", {}): every insertion is timed
        return
    if not recycles:
        for request in plan.requests:
            checker.check(request.id, first_tokens[request.id])
    link.send(("verified", checker.result()))
    link.recv()  # ("exit", {})
    claims.close()
    for receiver in receivers:
        receiver.close()
    ops.host_free(buffer)
