"""What the demo will run, decided up front by the parent: requests, blocks and steps.

A plan is plain data (JSON-able) handed to every process, so each computes the same schedule
and the decode side can recompute exactly what the prefill worker computed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pdhal_demo import MODES
from pdhal_demo.model import Chunk, ModelConfig, prompt_tokens


@dataclass(frozen=True)
class Request:
    id: int
    prompt_len: int
    prefill_blocks: list[int]  # block table in the prefill worker's cache
    decode_blocks: list[int]  # block table in the decode receiver's cache (prompt + decode)


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
    decode_steps: int
    requests: list[Request]
    steps: list[list[ChunkPlan]]  # the chunks each prefill step computes
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (prompt_len, why)
    signal_at_end: bool = False  # baseline: post every layer only after the forward pass
    tp: int = 1  # tensor-parallel ranks: a worker and a messager each, one decode receiver

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

    def request(self, request_id: int) -> Request:
        return self.requests[request_id]

    def prompts(self) -> dict[int, list[int]]:
        """Every request's prompt tokens (deterministic from the model's seed)."""
        return {r.id: prompt_tokens(self.model, r.id, r.prompt_len) for r in self.requests}

    def chunks(self, step: list[ChunkPlan], prompts: dict[int, list[int]],
               side: str) -> list[Chunk]:
        """The model's input for `step`, placed by the `side` ("prefill"/"decode") tables."""
        out = []
        for c in step:
            request = self.request(c.request)
            table = request.prefill_blocks if side == "prefill" else request.decode_blocks
            out.append(Chunk(request.id, c.start, prompts[request.id][c.start:c.start + c.length],
                             table, c.start + c.length == request.prompt_len))
        return out


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def make_plan(model: ModelConfig, prompt_lens: list[int], mode: str, transport: str,
              cache_blocks: int, decode_steps: int, batch: int, chunk_tokens: int,
              signal_at_end: bool = False, tp: int = 1) -> Plan:
    """Allocate blocks and schedule steps; prompts that cannot fit are rejected, not run.

    per_query: up to `batch` whole prompts per step. per_chunk: each step takes at most
    `chunk_tokens` tokens, splitting long prompts into chunks over several steps.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model.check_tp(tp)
    bs = model.block_size
    requests: list[Request] = []
    rejected: list[tuple[int, str]] = []
    prefill_used = 0
    # The decode side keeps block 0 unused (the null block engines reserve), so its tables
    # differ from the prefill side's and a transfer that ignored them would fail
    # verification. Prompt blocks come from the bottom; the blocks a request grows into
    # while decoding, from the top.
    decode_next, decode_top = 1, cache_blocks
    for length in prompt_lens:
        need = _blocks(length, bs)
        grow = _blocks(length + decode_steps, bs) - need
        if length < 1:
            rejected.append((length, "a prompt needs at least one token"))
        elif need + grow > cache_blocks - 1:
            rejected.append((length, f"needs {need + grow} blocks of {bs} tokens, the whole "
                                     f"cache has {cache_blocks - 1} (block 0 is reserved)"))
        elif prefill_used + need > cache_blocks or decode_next + need > decode_top - grow:
            rejected.append((length, f"the cache ({cache_blocks} blocks) is full with the "
                                     f"requests before it"))
        else:
            decode = (list(range(decode_next, decode_next + need))
                      + list(range(decode_top - grow, decode_top)))
            requests.append(Request(len(requests), length,
                                    list(range(prefill_used, prefill_used + need)), decode))
            prefill_used += need
            decode_next += need
            decode_top -= grow
    steps: list[list[ChunkPlan]] = []
    if mode == "per_query":
        for i in range(0, len(requests), batch):
            steps.append([ChunkPlan(r.id, 0, r.prompt_len) for r in requests[i:i + batch]])
    else:
        pending = [[r.id, 0, r.prompt_len] for r in requests]
        while pending:
            budget, step = chunk_tokens, []
            for item in pending:
                if budget == 0:
                    break
                take = min(budget, item[2] - item[1])
                step.append(ChunkPlan(item[0], item[1], take))
                item[1] += take
                budget -= take
            pending = [item for item in pending if item[1] < item[2]]
            steps.append(step)
    return Plan(model, mode, transport, cache_blocks, cache_blocks, decode_steps, requests,
                steps, rejected, signal_at_end, tp)
