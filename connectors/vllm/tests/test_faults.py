"""A dead messager or decode instance is reported, never waited on, and no request is decoded
on a partial cache: it is failed explicitly or recomputed, as kv_load_failure_policy says."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import after_prefill, prefill_first, prompts, write_prompts

from pdhal.testing.reset import remove_leftovers, segments_of


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_messager_dies_mid_transfer(cluster, plain_tokens, policy):
    """The messager exits once its streamer landed two layer submits (layers 0 and 1 of the
    step's requests): the decode cache holds part of their KV, and the decode instance must
    not use it."""
    items = prompts()
    path = write_prompts(cluster, items)
    cluster.start_messager("--exit-after-layers", "2", module="pdhal_vllm.testing.messager")
    cluster.start(
        "decode",
        path,
        "--policy",
        policy,
        "--submitted-file",
        cluster.path("decode.submitted"),
        *after_prefill(cluster),
    )
    cluster.start(
        "prefill", path, *prefill_first(cluster), "--wait-file", cluster.path("decode.submitted")
    )
    decode = cluster.wait("decode")
    prefill = cluster.wait("prefill")  # finishes: its held blocks are released
    assert all(len(r["tokens"]) == 1 for r in prefill["results"])
    assert "cache messager of rank 0 is gone" in cluster.log("prefill", 400)
    assert cluster.procs["messager"].wait(5) == 3  # the planted exit

    events = cluster.trace("decode0")
    failed = {e["tid"] for e in events if e["kind"] == "load_failed"}
    fault = next(e for e in cluster.trace("messager") if e["kind"] == "fault")
    # its streamer had written two layer submits into the decode cache: a partial cache
    assert fault["layers"] >= 2, "the fault must hit after some KV landed"
    assert failed == {item["tid"] for item in items}
    died = fault["t"]
    for item, result in zip(items, decode["results"]):
        # reported as soon as the connection dropped, not after the 60 s load timeout
        assert result["finished_ns"] - died < 20e9
        if policy == "fail":
            assert result["finish_reason"] == "error" and result["tokens"] == [], result
        else:
            assert result["tokens"] == plain_tokens[tuple(item["tokens"])], item["tid"]


def test_decode_killed(cluster, namespace):
    """The decode instance is killed after it claimed its KV, before the prefill computed
    it: the messager's service fails those transfers as soon as the prefill has them (not
    at the 120 s claim lease), the prefill instance is told and releases the blocks, and
    the messager goes on serving."""
    items = prompts()
    path = write_prompts(cluster, items)
    cluster.start_messager()
    go = cluster.path("decode.killed")
    cluster.start("prefill", path, *prefill_first(cluster), "--wait-file", go)
    decode = cluster.start(
        "decode",
        path,
        "--submitted-file",
        cluster.path("decode.submitted"),
        *after_prefill(cluster),
    )
    cluster.wait_file("decode.submitted")
    decode.send_signal(signal.SIGKILL)
    decode.wait(10)
    start = time.monotonic()
    open(go, "w").close()
    prefill = cluster.wait("prefill")
    assert time.monotonic() - start < 100
    assert all(len(r["tokens"]) == 1 for r in prefill["results"])
    failed = {e["tid"] for e in cluster.trace("prefill0") if e["kind"] == "failed"}
    assert failed == {item["tid"] for item in items}
    errors = [e["error"] for e in cluster.trace("messager") if e["kind"] == "error"]
    assert any("its decode side's session ended" in e for e in errors), errors
    assert "transfer r0-0 failed" in cluster.log("prefill", 400)
    assert cluster.procs["messager"].poll() is None  # still serving
    # what the killed decode left (its KV cache) the messager removed, no manual step
    assert [e for e in cluster.trace("messager") if e["kind"] == "reclaimed"]
    assert not [name for name in segments_of(namespace) if f".{decode.pid}." in name]
    cluster.stop()
    assert remove_leftovers(namespace) == []


def test_a_decode_request_aborted_mid_load_frees_its_blocks_at_once(cluster):
    """The decode instance aborts its requests right after it asked for their KV, before
    any prefill ran: their messager answers at once, so vLLM frees their blocks and the
    instance ends (within its 60 s, not at the 300 s load timeout). The prefill instance
    that computes them afterwards hears at once that nobody wants them (within its 60 s,
    not at the 100 s claim timeout)."""
    items = prompts()
    path = write_prompts(cluster, items)
    cluster.start_messager("--claim-timeout", "100")
    go = cluster.path("decode.json")  # the decode instance ended
    cluster.start("prefill", path, "--timeout", "60", *prefill_first(cluster), "--wait-file", go)
    cluster.start(
        "decode",
        path,
        "--cancel-after-submit",
        "--load-timeout",
        "300",
        "--timeout",
        "60",
        *after_prefill(cluster),
    )
    decode = cluster.wait("decode")
    assert not any(r["tokens"] for r in decode["results"])
    tids = {item["tid"] for item in items}
    assert {e["tid"] for e in cluster.trace("decode0") if e["kind"] == "cancelled"} == tids
    prefill = cluster.wait("prefill")
    assert all(len(r["tokens"]) == 1 for r in prefill["results"])
    assert {e["tid"] for e in cluster.trace("prefill0") if e["kind"] == "failed"} == tids
    errors = [e["error"] for e in cluster.trace("messager") if e["kind"] == "error"]
    for tid in tids:
        assert any(f"transfer {tid}: its decode side cancelled it" in e for e in errors), tid
