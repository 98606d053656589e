"""What the demo will run, decided up front by the parent: requests, blocks and steps.

A plan is plain data (JSON-able) handed to every process, so each computes the same schedule
and the decode side can recompute exactly what the prefill worker computed.

Blocks are recycled as a serving engine's cache manager does: a request takes its blocks
when its first chunk is scheduled; its prefill blocks come free once every rank's messager
has sent its last layer, its decode blocks once the decode side has checked it and is done
with it. When a request needs blocks that are not free, the plan frees those of requests
whose prefill ended in an earlier step and records the dependency: the worker waits, before
the step, until those requests are sent (`step_waits`), and the messager waits, before
writing the request's first block, until the decode side released them (`decode_waits`).
Every dependency points to an earlier step, so nothing waits in a circle. Batch slots (the
rows of a per-chunk step table) are recycled too: a request holds one from its first chunk
to its last.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field, replace

from pdhal_demo import MODES
from pdhal_demo.model import Chunk, ModelConfig, prompt_tokens

MAX_BATCH = 64  # batch slots of a per-chunk step table (pdhal allows up to MAX_REQUESTS)
_RESERVED = " (block 0 is reserved)"


@dataclass(frozen=True)
class Request:
    id: int
    prompt_len: int
    prefill_blocks: list[int]  # block table in the prefill worker's cache
    decode_blocks: list[int]  # block table in the decode receiver's cache (prompt + decode)
    slot: int = 0  # batch slot in a per-chunk step table, from its first chunk to its last
    decode_waits: list[int] = field(default_factory=list)  # released before its first write


@dataclass(frozen=True)
class ChunkPlan:
    request: int
    start: int
    length: int


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    mode: str
    transport: str
    prefill_cache_blocks: int
    decode_cache_blocks: int
    decode_block_size: int  # tokens of a decode cache block (model.block_size: the prefill's)
    decode_order: str  # how a decode block is ordered (ModelConfig.order; the prefill's)
    decode_steps: int
    requests: list[Request]
    steps: list[list[ChunkPlan]]  # the chunks each prefill step computes
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (prompt_len, why)
    signal_at_end: bool = False  # baseline: post every layer only after the forward pass
    tp: int = 1  # tensor-parallel ranks: a worker and a messager each, one decode receiver
    step_waits: list[list[int]] = field(default_factory=list)  # sent before step i starts
    max_batch: int = MAX_BATCH

    @property
    def recycles(self) -> bool:
        """Whether some request reuses another's blocks (the decode side then checks and
        releases each request as it arrives)."""
        return any(self.step_waits) or any(r.decode_waits for r in self.requests)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        data = dict(data)
        data["model"] = ModelConfig(**data["model"])
        data["requests"] = [Request(**r) for r in data["requests"]]
        data["steps"] = [[ChunkPlan(**c) for c in step] for step in data["steps"]]
        data["rejected"] = [tuple(r) for r in data["rejected"]]
        return cls(**data)

    @property
    def decode_model(self) -> ModelConfig:
        """The model as the decode side keeps its cache: blocks of decode_block_size, in
        decode_order."""
        return replace(self.model, block_size=self.decode_block_size, order=self.decode_order)

    def request(self, request_id: int) -> Request:
        return self.requests[request_id]

    def decode_prompt_blocks(self, request_id: int) -> list[int]:
        """The decode blocks a request's prompt fills (what its transfer writes)."""
        request = self.request(request_id)
        return request.decode_blocks[: _blocks(request.prompt_len, self.decode_block_size)]

    def prompts(self) -> dict[int, list[int]]:
        """Every request's prompt tokens (deterministic from the model's seed)."""
        return {r.id: prompt_tokens(self.model, r.id, r.prompt_len) for r in self.requests}

    def chunks(
        self, step: list[ChunkPlan], prompts: dict[int, list[int]], side: str
    ) -> list[Chunk]:
        """The model's input for `step`, placed by the `side` ("prefill"/"decode") tables."""
        out = []
        for c in step:
            request = self.request(c.request)
            table = request.prefill_blocks if side == "prefill" else request.decode_blocks
            out.append(
                Chunk(
                    request.id,
                    c.start,
                    prompts[request.id][c.start : c.start + c.length],
                    table,
                    c.start + c.length == request.prompt_len,
                )
            )
        return out

    def chunks_of(self, request_id: int) -> list[ChunkPlan]:
        """A request's chunks, in the order the steps compute them."""
        return [c for step in self.steps for c in step if c.request == request_id]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Pool:
    """Free ids, lowest first (so tables stay consecutive), who holds the rest, and who held
    each free id last (whoever takes it must wait until that request let it go)."""

    def __init__(self, ids):
        self.free = sorted(ids)
        self.held: list[tuple[int, list[int], int | None]] = []  # (request, ids, done step)
        self.last_owner: dict[int, int] = {}

    def available(self, step: int) -> int:
        """Ids free for `step` once the requests done before it let theirs go."""
        return len(self.free) + sum(
            len(ids) for _, ids, done in self.held if done is not None and done < step
        )

    def take(self, request: int, count: int, step: int, top: int = 0) -> tuple[list[int], set[int]]:
        """`count` ids from the bottom, then `top` more from the top (`available` must
        allow it), freeing those of requests done before `step`, oldest first, as needed;
        and the requests that held them last."""
        for holder in [h for h in self.held if h[2] is not None and h[2] < step]:
            if len(self.free) >= count + top:
                break
            self.held.remove(holder)
            for block in holder[1]:
                bisect.insort(self.free, block)
                self.last_owner[block] = holder[0]
        ids = self.free[:count] + (self.free[len(self.free) - top :] if top else [])
        del self.free[:count]
        if top:
            del self.free[len(self.free) - top :]
        self.held.append((request, ids, None))
        return ids, {self.last_owner.pop(i) for i in ids if i in self.last_owner}

    def finish(self, request: int, step: int) -> None:
        self.held = [(r, ids, step if r == request else done) for r, ids, done in self.held]


def make_plan(
    model: ModelConfig,
    prompt_lens: list[int],
    mode: str,
    transport: str,
    cache_blocks: int,
    decode_steps: int,
    batch: int,
    chunk_tokens: int,
    signal_at_end: bool = False,
    tp: int = 1,
    max_batch: int = MAX_BATCH,
    decode_block_size: int | None = None,
    decode_order: str | None = None,
) -> Plan:
    """Allocate blocks and schedule steps; prompts that can never fit are rejected, not run.

    per_query: up to `batch` whole prompts per step. per_chunk: each step takes at most
    `chunk_tokens` tokens, splitting long prompts into chunks over several steps, and at
    most `max_batch` requests hold a batch slot at once. Blocks are recycled (see above).
    `cache_blocks` blocks of the model's block size on each side; `decode_block_size`
    (default: the model's) the tokens of a decode block, the decode cache as many whole
    blocks of it as the prefill cache's tokens fill; `decode_order` (default: the model's)
    how a decode block is ordered.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model.check_tp(tp)
    bs = model.block_size
    dbs = bs if decode_block_size is None else decode_block_size
    if dbs < 1:
        raise ValueError(f"decode_block_size must be at least 1 token, got {dbs}")
    decode_cache_blocks = cache_blocks * bs // dbs
    # (prompt_len, prompt blocks, decode prompt blocks, decode growth blocks)
    accepted: list[tuple[int, int, int, int]] = []
    rejected: list[tuple[int, str]] = []
    for length in prompt_lens:
        need, decode_need = _blocks(length, bs), _blocks(length, dbs)
        grow = _blocks(length + decode_steps, dbs) - decode_need
        if length < 1:
            rejected.append((length, "a prompt needs at least one token"))
        elif need > cache_blocks or decode_need + grow > decode_cache_blocks - 1:
            # The decode side keeps block 0 unused (the null block engines reserve), so its
            # tables differ from the prefill side's and a transfer that ignored them would
            # fail verification.
            short = [
                f"{n} blocks of {size} tokens to {what}, the cache has {have}{note}"
                for n, size, what, have, note in (
                    (need, bs, "prefill", cache_blocks, ""),
                    (decode_need + grow, dbs, "decode", decode_cache_blocks - 1, _RESERVED),
                )
                if n > have
            ]
            rejected.append((length, "needs " + "; ".join(short)))
        else:
            accepted.append((length, need, decode_need, grow))
    prefill, decode = _Pool(range(cache_blocks)), _Pool(range(1, decode_cache_blocks))
    slots = _Pool(range(max_batch))
    tables: dict[int, tuple[list[int], list[int], int, list[int]]] = {}
    steps: list[list[ChunkPlan]] = []
    step_waits: list[list[int]] = []
    queue = list(range(len(accepted)))  # not started yet, in order
    active: list[list[int]] = []  # [request, tokens done] of started, unfinished requests

    def admit(request: int, step: int, waits: set[int]) -> bool:
        """Give `request` its slot and blocks for `step`, freeing earlier ones' if need be."""
        length, need, decode_need, grow = accepted[request]
        if (
            slots.available(step) < 1
            or prefill.available(step) < need
            or decode.available(step) < decode_need + grow
        ):
            return False
        slot, _ = slots.take(request, 1, step)
        p_blocks, reused = prefill.take(request, need, step)
        waits.update(reused)  # their prefill blocks are reused: they must be sent first
        # prompt blocks from the bottom, the blocks it grows into while decoding from the top
        d_blocks, released = decode.take(request, decode_need, step, top=grow)
        tables[request] = (p_blocks, d_blocks, slot[0], released)
        return True

    while queue or active:
        index, step, waits = len(steps), [], set()
        budget = chunk_tokens if mode == "per_chunk" else None
        for item in list(active):  # chunked prompts in progress go first
            if budget == 0:
                break
            take = min(budget, accepted[item[0]][0] - item[1])
            step.append(ChunkPlan(item[0], item[1], take))
            item[1] += take
            budget -= take
        while (
            queue
            and (budget is None and len(step) < batch or budget)
            and admit(queue[0], index, waits)
        ):
            request = queue.pop(0)
            length = accepted[request][0]
            take = length if budget is None else min(budget, length)
            step.append(ChunkPlan(request, 0, take))
            if budget is not None:
                budget -= take
                if take < length:
                    active.append([request, take])
        if not step:
            raise AssertionError("a request that fits an empty cache found no room")
        for c in step:
            if c.start + c.length == accepted[c.request][0]:  # its prefill ends here
                active = [a for a in active if a[0] != c.request]
                for pool in (slots, prefill, decode):
                    pool.finish(c.request, index)
        steps.append(step)
        step_waits.append(sorted(waits))
    requests = [
        Request(i, accepted[i][0], tables[i][0], tables[i][1], tables[i][2], sorted(tables[i][3]))
        for i in range(len(accepted))
    ]
    return Plan(
        model,
        mode,
        transport,
        cache_blocks,
        decode_cache_blocks,
        dbs,
        decode_order or model.order,
        decode_steps,
        requests,
        steps,
        rejected,
        signal_at_end,
        tp,
        step_waits,
        max_batch,
    )
