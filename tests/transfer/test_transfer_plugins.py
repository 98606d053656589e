"""Transports from other distributions: found through entry-point group pdhal.transports,
listed by `pdhal info`, a broken one named loudly; and, through a test-only transport that
stalls or fails the submit a test names, the streamer's failure semantics: the failed
request ends on both sides, the next one lands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pdhal
from pdhal import transfer
from pdhal._transfer import plugins as _transports
from pdhal.testing.fixtures import install_distributions
from pdhal.testing.transfer_peers import (
    BLOCK_TOKENS,
    LAYERS,
    Decode,
    expected,
    landed_blocks,
    outcomes_until,
    source_caches,
)

PLUGIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "transports"
)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    target = tmp_path_factory.mktemp("transports")
    return target, install_distributions(target, PLUGIN)


@pytest.fixture
def installed(plugin_env, monkeypatch):
    """This process sees the test transports (sys.path), and forgets them afterwards."""
    target, _ = plugin_env
    monkeypatch.syspath_prepend(str(target))
    _transports.forget()
    yield
    _transports.forget()


def test_info_lists_every_transport_and_names_the_broken_one(plugin_env):
    _, env = plugin_env
    out = subprocess.run(
        [sys.executable, "-m", "pdhal", "info", "--json"],
        env=dict(env, PDHAL_PLATFORM="cpu"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = {t["name"]: t for t in json.loads(out)["transports"]}
    assert found["shm"] == {
        "name": "shm",
        "source": "built in",
        "status": "ok",
        "completion": "target",
        "options": {},
    }
    # built in, and refused in a process without device memory, which info says
    assert found["ipc"]["status"] == "unavailable"
    assert "has no device memory: use shm" in found["ipc"]["error"]
    assert found["faulty"]["completion"] == "target"
    assert found["faulty"]["status"] == "ok"
    assert found["faulty"]["source"] == "pdhal-test-transports 0.0.1"
    assert found["bad"]["status"] == "broken"
    assert "pdhal_bad_transport (entry point 'bad' in pdhal.transports)" in found["bad"]["error"]
    assert "not a pdhal.transfer.Transport named 'bad'" in found["bad"]["error"]


def test_a_broken_transport_is_an_error_naming_its_plugin(installed):
    assert {"bad", "faulty", "shm"} <= set(transfer.transports())
    with pytest.raises(pdhal.TransportLoadError, match="entry point 'bad' in pdhal.transports"):
        transfer.transport("bad")


@pytest.mark.parametrize("fault, words", [("stall:2", "injected stall"), ("fail:2", "injected")])
def test_a_stalled_or_failed_submit_breaks_its_decode_side_and_not_the_next_request(
    installed, monkeypatch, fault, words
):
    """Request "a"'s layer 1 (the 2nd submit) stalls past stall_timeout, or fails: the
    decode side is broken as a whole, so "a" and "b", in flight there with it, fail on the
    prefill side naming the fault and on the decode side by its deadline (the link that
    would tell it is not to be trusted); "c", sent after, lands over a new link."""
    monkeypatch.setenv("PDHAL_FAULTY_TRANSPORT", fault)
    decode = Decode()
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()),
        BLOCK_TOKENS,
        transport_name="faulty",
        stall_timeout=0.2,
    )
    try:
        dest = streamer.connect(decode.described)
        for request, src, dst in (("a", [0], [1]), ("b", [2], [3])):
            streamer.add_request(request, src, 4)
            streamer.set_destination(request, dest, dst, decode.expect(request, timeout=1))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("b", 4)])
        ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
        assert not ended["a"].landed and words in ended["a"].reason
        assert not ended["b"].landed and words in ended["b"].reason
        for request in ("a", "b"):
            landed, reason, _, _ = decode.wait(request)
            assert not landed and "nothing landed within 1 s" in reason
        streamer.add_request("c", [2], 4)
        streamer.set_destination("c", dest, [3], decode.expect("c"))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("c", 4)])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("c", True)]
        landed, _, dump, _ = decode.wait("c")
        assert landed and landed_blocks(dump, 3) == expected(2)
        assert streamer.metrics.snapshot()["requests_failed"] == 2
    finally:
        streamer.close()
        decode.close()


def test_a_request_has_not_landed_while_a_layer_of_it_is_in_flight(installed, monkeypatch):
    """Layer 0 lands late (delayed), layer 2 never (stalled), layer 1 between: when layer 0
    lands, every layer has been submitted but two are in flight; the request must not be
    reported landed then, and ends failed on both sides once layer 2 stalls."""
    monkeypatch.setenv("PDHAL_FAULTY_TRANSPORT", "delay:1,stall:3")
    decode = Decode()
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()),
        BLOCK_TOKENS,
        transport_name="faulty",
        stall_timeout=0.3,
    )
    try:
        streamer.add_request("a", [0], 4)
        dest = streamer.connect(decode.described)
        streamer.set_destination("a", dest, [1], decode.expect("a", timeout=2))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        [ended] = outcomes_until(streamer, 1)
        assert not ended.landed and "injected stall" in ended.reason
        landed, reason, _, _ = decode.wait("a")
        assert not landed and "nothing landed within 2 s" in reason
    finally:
        streamer.close()
        decode.close()


def test_a_request_failed_while_a_layer_is_in_flight_is_reported_after_it(installed, monkeypatch):
    """fail() while layer 0 may still be in flight (delayed): the failure goes out once
    that write settled (or it is dropped unsent), so the decode side, told FAILED, never
    has a write still to come into blocks it may give to another request: what its block
    holds when it reads FAILED is what it holds once the streamer settled everything."""
    monkeypatch.setenv("PDHAL_FAULTY_TRANSPORT", "delay:1")
    decode = Decode()
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, transport_name="faulty"
    )
    try:
        streamer.add_request("a", [0], 4)
        streamer.set_destination("a", streamer.connect(decode.described), [5], decode.expect("a"))
        streamer.layer_ready(0, [("a", 4)])
        streamer.fail("a", "given up")
        landed, reason, dump, _ = decode.wait("a")
        assert not landed and reason == "given up"
        at_failed = landed_blocks(dump, 5)[0]
        assert at_failed in (expected(0)[0], [0] * len(at_failed))
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", False, "given up")]
        streamer.close()  # every write settled
        assert [decode.block(0, c, 5)[0] for c in range(len(at_failed))] == at_failed, (
            "a write came after the FAILED"
        )
    finally:
        streamer.close()
        decode.close()


def test_a_stalled_decode_side_never_holds_up_the_caller_or_another(installed, monkeypatch):
    """One layer in flight at most; decode side "slow"'s first submit stalls. Its later
    layers wait in its own backlog: the caller goes on at once, and decode side "fast",
    signalled after, lands first; "slow"'s request then fails with the stall (and nothing
    more is written to "slow", which learns it by its own bound: 5 s here, 10x the stall
    timeout, so the prefill side's stall is what ends it)."""
    monkeypatch.setenv("PDHAL_FAULTY_TRANSPORT", "stall:1@slow")
    slow, fast = Decode("slow"), Decode("fast")
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()),
        BLOCK_TOKENS,
        transport_name="faulty",
        max_layers_in_flight=1,
        stall_timeout=0.5,
    )
    try:
        for request, decode in (("s", slow), ("f", fast)):
            streamer.add_request(request, [0], 4)
            dest = streamer.connect(decode.described)
            streamer.set_destination(request, dest, [0], decode.expect(request, timeout=5.0))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("s", 4)])
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("f", 4)])
        ended = outcomes_until(streamer, 2)
        assert [o.request_id for o in ended] == ["f", "s"], ended
        assert ended[0].landed and not ended[1].landed and "injected stall" in ended[1].reason
        assert fast.wait("f")[0] and not slow.wait("s")[0]
    finally:
        streamer.close()
        slow.close()
        fast.close()
