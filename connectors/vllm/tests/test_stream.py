"""A prefill vLLM instance streams each layer's KV through pdhal and a messager process into
a decode vLLM instance, which then decodes exactly what a plain run decodes."""

from __future__ import annotations

import pytest
from conftest import (
    KV_HEADS,
    LAYERS,
    LONG_PROMPT_LENS,
    MAX_TOKENS,
    after_prefill,
    head_crcs,
    prefill_first,
    prompts,
    write_prompts,
)


def run_pd(cluster, items, transport: str = "shm", *extra: str) -> tuple[dict, dict]:
    """Messager, then decode (asks for its KV once the prefill instance is up: its worker
    made the messager's service), then prefill once the decode side asked (in sync mode the
    decode's first step waits for the KV: the prefill starts once the decode engine is
    up)."""
    path = write_prompts(cluster, items)
    cluster.start_messager("--transport", transport)
    go = "decode.ready" if "sync" in extra else "decode.submitted"
    cluster.start(
        "decode",
        path,
        "--transport",
        transport,
        "--submitted-file",
        cluster.path("decode.submitted"),
        "--ready-file",
        cluster.path("decode.ready"),
        *after_prefill(cluster),
        *extra,
    )
    cluster.start("prefill", path, *prefill_first(cluster), "--wait-file", cluster.path(go))
    decode = cluster.wait("decode")
    prefill = cluster.wait("prefill")
    return prefill, decode


def check_stream(cluster, items, sync: bool = False) -> None:
    """Every layer's signal was posted in order and seen before its bytes were read; every
    block the decode side loads is, byte for byte (crc32), what the prefill wrote, what the
    messager read (every prompt block: it sends what each decode side claims) and what the
    decode cache holds."""
    prefill, messager, decode = (cluster.trace(w) for w in ("prefill0", "messager", "decode0"))
    signals = [e for e in prefill if e["kind"] == "signal"]
    steps = sorted({e["step"] for e in signals})
    assert steps, "the prefill posted no layer signal"
    for step in steps:
        assert [e["layer"] for e in signals if e["step"] == step] == list(range(LAYERS))
    posted = {(e["step"], e["layer"]): e["t"] for e in signals}
    seen = [e for e in messager if e["kind"] == "seen"]
    tables = [e for e in messager if e["kind"] == "table"]
    reads = [e for e in messager if e["kind"] == "read"]
    assert reads
    for read in reads:
        # the step it was read for: the newest table naming it (a chunked prompt is in
        # several steps' tables)
        step = max(e["step"] for e in tables if read["tid"] in e["tids"] and e["t"] <= read["t"])
        # the read follows a wake-up that covered this layer, which followed its post
        covering = [
            s
            for s in seen
            if (s["step"], s["layer"]) >= (step, read["layer"]) and s["t"] <= read["t"]
        ]
        assert covering, f"layer {read['layer']} of {read['tid']} was read before its signal"
        assert posted[step, read["layer"]] <= covering[0]["t"]
    for item in items:  # the layers of a transfer land in order, each once
        landed = [e["layer"] for e in decode if e["kind"] == "landed" and e["tid"] == item["tid"]]
        assert landed == list(range(LAYERS)), (item["tid"], landed)
    written, read_, held = head_crcs(prefill), head_crcs(messager), head_crcs(decode)
    # sync: the decode side computes the last prompt token itself, so it loads one less
    blocks = {
        (item["tid"], layer, i, head)
        for item in items
        for layer in range(LAYERS)
        for i in range(-(-(len(item["tokens"]) - sync) // 32))
        for head in range(KV_HEADS)
    }
    assert set(read_) >= blocks and set(written) >= blocks
    assert {k: read_[k] for k in blocks} == {k: written[k] for k in blocks}
    assert {k: held[k] for k in blocks} == {k: read_[k] for k in blocks}


@pytest.mark.parametrize("transport", ["shm", "mooncake", "nixl"])
def test_decode_equals_plain_run(cluster, plain_tokens, transport):
    items = prompts()
    prefill, decode = run_pd(cluster, items, transport)
    for item, result in zip(items, decode["results"]):
        assert result["finish_reason"] == "length", result
        assert result["tokens"] == plain_tokens[tuple(item["tokens"])], item["tid"]
        assert len(result["tokens"]) == MAX_TOKENS
    assert all(len(r["tokens"]) == 1 for r in prefill["results"])
    check_stream(cluster, items)
    errors = [
        e
        for e in cluster.trace("messager")
        if e["kind"] == "error"
        and "went: the peer closed the connection" not in e["error"]
        and "died" not in e["error"]
    ]
    assert not errors


def test_sync_load_waits_per_layer(cluster, plain_tokens):
    """load_mode sync: the decode request is scheduled at once and each attention layer
    waits for its own layer only; the tokens are the plain run's all the same."""
    items = prompts(seed=1)
    prefill, decode = run_pd(cluster, items, "shm", "--load-mode", "sync")
    for item, result in zip(items, decode["results"]):
        assert result["tokens"] == plain_tokens[tuple(item["tokens"])], item["tid"]
    check_stream(cluster, items, sync=True)


def test_decode_asked_last(cluster, plain_tokens):
    """The decode instance asks only after the prefill instance computed every prompt (its
    tables came first, so the messager gave the streamer the whole prompts): in sync mode it
    needs one token less, which for the 65-token prompt is one block less, and gets exactly
    that; the tokens are the plain run's."""
    items = prompts(seed=1)
    path = write_prompts(cluster, items)
    cluster.start_messager()
    cluster.start("prefill", path, "--submitted-file", cluster.path("prefill.submitted"))
    cluster.wait_file("prefill.submitted")
    cluster.start("decode", path, "--load-mode", "sync")
    decode = cluster.wait("decode")
    cluster.wait("prefill")
    for item, result in zip(items, decode["results"]):
        assert result["tokens"] == plain_tokens[tuple(item["tokens"])], item["tid"]
    first_want = min(e["t"] for e in cluster.trace("decode0") if e["kind"] == "want")
    assert max(e["t"] for e in cluster.trace("messager") if e["kind"] == "table") < first_want
    check_stream(cluster, items, sync=True)


def test_a_prompt_the_decode_side_has_cached_frees_the_prefill_blocks_at_once(
    cluster, plain_tokens
):
    """load_mode sync, prefix caching on the decode side: the same 65-token prompt twice,
    one after the other. The second time the decode side's cache holds all of it but the
    last token, which it computes itself, so it needs nothing: it says so at once, and the
    messager ends the transfer (as sent, not failed) instead of holding the prefill's blocks
    until the claim timeout (100 s here, past the prefill instance's 60 s)."""
    tokens = prompts(seed=1)[2]["tokens"]  # 65 tokens: 2 full blocks and 1 token
    items = [{"tid": "first", "tokens": tokens}, {"tid": "again", "tokens": tokens}]
    path = write_prompts(cluster, items)
    cluster.start_messager("--claim-timeout", "100")
    cluster.start(
        "decode",
        path,
        "--load-mode",
        "sync",
        "--prefix-caching",
        "--sequential",
        "--ready-file",
        cluster.path("decode.ready"),
        *after_prefill(cluster),
    )
    cluster.start(
        "prefill",
        path,
        "--sequential",
        "--timeout",
        "60",
        *prefill_first(cluster),
        "--wait-file",
        cluster.path("decode.ready"),
    )
    decode = cluster.wait("decode")
    cluster.wait("prefill")  # its blocks came free: it did not wait for the claim timeout
    for result in decode["results"]:
        assert result["tokens"] == plain_tokens[tuple(tokens)], result["tid"]
    assert [e["tid"] for e in cluster.trace("decode0") if e["kind"] == "unneeded"] == ["again"]
    messager = cluster.trace("messager")
    assert sorted(e["tid"] for e in messager if e["kind"] == "sent") == ["again", "first"]
    assert not [e for e in messager if e["kind"] == "error" and "again" in e["error"]]


def test_a_chunked_prefill_streams_each_chunk_s_blocks_as_they_fill(cluster, plain_tokens):
    """A 300-token prompt on a prefill instance that computes 64 tokens a step: its
    blocks go out chunk by chunk (vLLM allocates them chunk by chunk too), in the steps
    before the last, not all with the last; the decode's tokens are the plain run's, every
    block byte for byte where the prefill wrote it."""
    items = prompts(LONG_PROMPT_LENS, seed=2)
    path = write_prompts(cluster, items)
    cluster.start_messager()
    cluster.start(
        "decode",
        path,
        "--submitted-file",
        cluster.path("decode.submitted"),
        *after_prefill(cluster),
    )
    cluster.start(
        "prefill",
        path,
        "--max-num-batched-tokens",
        "64",
        *prefill_first(cluster),
        "--wait-file",
        cluster.path("decode.submitted"),
    )
    decode = cluster.wait("decode")
    cluster.wait("prefill")
    [result] = decode["results"]
    assert result["tokens"] == plain_tokens[tuple(items[0]["tokens"])]
    messager = cluster.trace("messager")
    steps = sorted({e["step"] for e in messager if e["kind"] == "table"})
    assert len(steps) >= 5  # 300 tokens, 64 a step
    sent = {}
    for e in messager:
        if e["kind"] == "landed":
            sent[e["step"]] = sent.get(e["step"], 0) + e["nbytes"]
    early = sum(n for step, n in sent.items() if step != steps[-1])
    assert early > sum(sent.values()) / 2, sent  # most of it before the last chunk
    check_stream(cluster, items)
