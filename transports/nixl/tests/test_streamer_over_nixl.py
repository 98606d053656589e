"""pdhal.transfer's streamer over NIXL (UCX over TCP on loopback, no RDMA here), real processes:
every byte lands; a killed decode process and a stopped one (SIGSTOP: its writes stall)
end their transfers as failed on both sides within the bounds the caller set, and the next
decode process is served. (The transport contract itself: `pytest --pdhal-transport
nixl`.)"""

from __future__ import annotations

import re

import pytest

import pdhal
from pdhal import transfer
from pdhal.testing.transfer_peers import (
    BLOCK_TOKENS,
    LAYERS,
    Decode,
    Prefill,
    expected,
    landed_blocks,
    outcomes_until,
    source_caches,
)


def _streamer(stall_timeout: float) -> transfer.KVStreamer:
    return transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()),
        BLOCK_TOKENS,
        transport_name="nixl",
        stall_timeout=stall_timeout,
    )


@pytest.fixture
def streamer():
    """A streamer whose bounds no loaded machine reaches where nothing stalls."""
    s = _streamer(30.0)
    yield s
    s.close()


@pytest.fixture
def impatient():
    """A streamer that gives a stalled write up after 1 s."""
    s = _streamer(1.0)
    yield s
    s.close()


def _send(streamer, decode, request, src, dst, timeout=30.0):
    streamer.add_request(request, src, len(src) * BLOCK_TOKENS)
    dest = streamer.connect(decode.described)
    streamer.set_destination(request, dest, dst, decode.expect(request, timeout))
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [(request, len(src) * BLOCK_TOKENS)])


def test_every_block_lands_through_nixl(streamer):
    decode = Decode("nx-decode", "nixl")
    try:
        _send(streamer, decode, "a", [1, 2, 5], [0, 1, 7])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
        landed, _, dump, uniform = decode.wait("a")
        assert landed and uniform
        for src, dst in zip([1, 2, 5], [0, 1, 7]):
            assert landed_blocks(dump, dst) == expected(src)
    finally:
        decode.close()


def test_a_stopped_decode_process_fails_by_the_stall_timeout_then_one_is_served(
    impatient, namespace
):
    """SIGSTOP the decode process: the request fails on the prefill side after
    stall_timeout (its blocks may be freed); a second decode process is served meanwhile;
    the stopped one, once it runs again, ends the request exactly once."""
    stopped, other = Decode("nx-stopped", "nixl"), Decode("nx-other", "nixl")
    try:
        ticket = stopped.expect("s", timeout=2.0)
        dest = impatient.connect(stopped.described)  # connected, then stopped
        stopped.stop()
        impatient.add_request("s", [0, 1, 2, 3, 4, 5, 6, 7], 8 * BLOCK_TOKENS)
        impatient.set_destination("s", dest, list(range(8)), ticket)
        for layer in range(LAYERS):
            impatient.layer_ready(layer, [("s", 8 * BLOCK_TOKENS)])
        _send(impatient, other, "o", [3], [3])
        ended = {o.request_id: o for o in outcomes_until(impatient, 2)}
        assert ended["o"].landed and other.wait("o")[0]
        assert not ended["s"].landed
        assert re.search(r"did not land within [\d.]+ s", ended["s"].reason)
        stopped.resume()
        # Its writes stalled in UCX (TCP: the stopped side's UCX must take them in): once it
        # runs they may land, or the streamer's closed link dropped them. The decode side
        # ends once: landed with every byte, or by its deadline.
        landed, reason, dump, _ = stopped.wait("s")
        if landed:
            assert all(landed_blocks(dump, b) == expected(b) for b in range(8))
        else:
            assert "nothing landed within 2 s" in reason
    finally:
        stopped.resume()
        stopped.close()
        other.close()


def test_a_killed_decode_process_fails_its_transfer_and_the_next_one_is_served(streamer, namespace):
    """SIGKILL the decode process between connecting and sending: its request fails (a
    write to it fails at once); what it leaves is only its own memory; the next decode
    process is served."""
    doomed = Decode("nx-doomed", "nixl")
    dest = streamer.connect(doomed.described)
    ticket = doomed.expect("d")
    doomed.kill()
    streamer.add_request("d", [0], BLOCK_TOKENS)
    streamer.set_destination("d", dest, [0], ticket)
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("d", BLOCK_TOKENS)])
    [ended] = outcomes_until(streamer, 1)
    assert ended.request_id == "d" and not ended.landed and ended.reason
    removed, left = pdhal.cleanup(namespace)
    assert left == [] and removed and all(f".{doomed.proc.pid}." in p for p in removed)
    again = Decode("nx-again", "nixl")
    try:
        _send(streamer, again, "e", [4], [2])
        assert outcomes_until(streamer, 1) == [transfer.Outcome("e", True)]
        assert again.wait("e")[0]
    finally:
        again.close()


def test_a_killed_prefill_process_fails_the_transfer_on_the_decode_side_by_its_deadline():
    """SIGKILL the prefill side (the messager) after its first layer went through
    NIXL: the decode side never sees the request landed; it ends as failed by its
    deadline, with nothing of the layers never sent."""
    decode = Decode("nx-orphan", "nixl")
    prefill = Prefill("nixl")
    try:
        prefill.send("connect", decode.described)
        prefill.send("add", "o", [1], [2], decode.expect("o", timeout=3.0))
        prefill.send("layer", 0, [["o", BLOCK_TOKENS]])
        prefill.kill()
        landed, reason, dump, _ = decode.wait("o")
        assert not landed and "nothing landed within 3 s" in reason
        assert landed_blocks(dump, 2)[1:] == [[0, 0]] * (LAYERS - 1)
    finally:
        decode.close()
