"""pdhal.transfer over the built-in shm transport: a decode process's KVReceiver and this
process's KVStreamer, real processes, every byte checked. Blocks go as their layer's signal
makes them ready (a partial last block only once the prompt is whole), runs coalesce, a
destination may come before or after the layers; each transfer ends exactly once on each
side, within a bound, whatever dies: the decode process (SIGKILL), the prefill process
(SIGKILL), a request nobody claims."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import pdhal
from pdhal import transfer
from pdhal.testing.fixtures import python_child
from pdhal.testing.transfer_peers import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    BLOCKS,
    CACHES,
    LAYERS,
    Decode,
    expected,
    landed_blocks,
    layers_until,
    outcomes_until,
    source_caches,
)


@pytest.fixture
def streamer():
    s = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, claim_timeout=30
    )
    yield s
    s.close()


def test_every_layer_s_blocks_land_as_chunks_fill_them(decode, streamer):
    """Chunked prefill: 10 tokens in blocks of 4 arrive as 6, then 10. After the first
    chunk only the first full block of each layer may be in the destination; the partial
    last block goes once the prompt is whole."""
    ticket = decode.expect("a")
    streamer.add_request("a", [2, 3, 4], 10)
    streamer.set_destination("a", streamer.connect(decode.described), [5, 6, 0], ticket)
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("a", 6)])
    assert streamer.poll() == [] and streamer.pending() == 1
    first = layers_until(streamer, LAYERS)  # one full block of each layer went, not the partial
    assert [(r.layer, r.nbytes) for r in first] == [
        (n, CACHES * BLOCK_BYTES) for n in range(LAYERS)
    ]
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("a", 10)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
    landed, reason, dump, uniform = decode.wait("a")
    assert landed and reason == "" and uniform
    for src, dst in zip([2, 3, 4], [5, 6, 0]):
        assert landed_blocks(dump, dst) == expected(src), f"block {src} -> {dst}"
    untouched = [b for b in range(BLOCKS) if b not in (5, 6, 0)]
    assert all(landed_blocks(dump, b) == [[0] * CACHES] * LAYERS for b in untouched)
    snapshot = streamer.metrics.snapshot()
    assert snapshot["bytes_landed"] == LAYERS * CACHES * 3 * BLOCK_BYTES
    assert snapshot["requests_landed"] == 1 and snapshot["requests_failed"] == 0


def test_a_destination_known_late_gets_the_layers_ready_before_it(decode, streamer):
    """The decode side may be asked last (as vLLM's connector does): every layer signalled
    before the destination came goes when it comes."""
    streamer.add_request("late", [0, 1], 8)
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("late", 8)])
    ticket = decode.expect("late")
    streamer.set_destination("late", streamer.connect(decode.described), [3, 7], ticket)
    assert outcomes_until(streamer, 1) == [transfer.Outcome("late", True)]
    landed, _, dump, _ = decode.wait("late")
    assert landed
    assert landed_blocks(dump, 3) == expected(0) and landed_blocks(dump, 7) == expected(1)


def test_a_prefix_the_decode_side_cached_is_not_sent(decode, streamer):
    """Prefix caching: of a 16-token prompt (4 blocks), the decode side has the first 2; the
    last 2 go (source blocks 6, 7 -> 2, 3) as the tokens past the prefix fill them."""
    streamer.add_request("p", [6, 7], 16, cached_blocks=2)
    streamer.set_destination("p", streamer.connect(decode.described), [2, 3], decode.expect("p"))
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("p", 8)])  # only the cached prefix: nothing to send
    assert streamer.metrics.layers() == []
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("p", 16)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("p", True)]
    landed, _, dump, _ = decode.wait("p")
    assert (
        landed and landed_blocks(dump, 2) == expected(6) and landed_blocks(dump, 3) == expected(7)
    )
    assert landed_blocks(dump, 0) == [[0] * CACHES] * LAYERS
    with pytest.raises(pdhal.InvalidArgumentError, match="needs 2 source blocks; 0 given, then 3"):
        streamer.add_request("q", [0, 1, 2], 16, cached_blocks=2)


def test_source_blocks_may_come_chunk_by_chunk(decode, streamer):
    """vLLM allocates a chunked prompt's blocks as its chunks are scheduled: a request may
    be added with its first blocks, the rest given by add_blocks, each layer's blocks going
    as soon as both their tokens and their ids are there."""
    dest = streamer.connect(decode.described)
    streamer.add_request("c", [4], 12)  # 3 blocks of 4 tokens; the first one's id only
    streamer.set_destination("c", dest, [1, 2, 3], decode.expect("c"))
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("c", 8)])  # two full blocks' tokens, one block's id
    assert [r.nbytes for r in layers_until(streamer, LAYERS)] == [CACHES * BLOCK_BYTES] * LAYERS
    streamer.add_blocks("c", [5])  # the second block goes at once, every layer
    assert len(layers_until(streamer, 2 * LAYERS)) == 2 * LAYERS
    streamer.add_blocks("c", [6])
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("c", 12)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("c", True)]
    landed, _, dump, _ = decode.wait("c")
    assert landed
    for src, dst in ((4, 1), (5, 2), (6, 3)):
        assert landed_blocks(dump, dst) == expected(src)


def test_the_decode_side_may_need_fewer_tokens_and_have_a_prefix(decode, streamer):
    """The prefill side added the whole prompt (9 tokens: 3 blocks) before its decode side
    said what it needs: 8 tokens (vLLM's decode computes the last one itself), and it has
    the first block cached: only the second block goes, and the request lands without the
    third."""
    streamer.add_request("f", [1, 2, 3], 9)
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("f", 9)])
    streamer.set_destination(
        "f",
        streamer.connect(decode.described),
        [6],
        decode.expect("f"),
        tokens=8,
        cached_blocks=1,
    )
    assert outcomes_until(streamer, 1) == [transfer.Outcome("f", True)]
    landed, _, dump, _ = decode.wait("f")
    assert landed and landed_blocks(dump, 6) == expected(2)
    assert all(landed_blocks(dump, b) == [[0] * CACHES] * LAYERS for b in range(BLOCKS) if b != 6)
    assert streamer.metrics.snapshot()["bytes_landed"] == LAYERS * CACHES * BLOCK_BYTES
    # a prefix the decode side has, of a request whose source blocks are not all known yet
    streamer.add_request("g", [0], 12)
    streamer.set_destination(
        "g", streamer.connect(decode.described), [4, 5], decode.expect("g"), cached_blocks=1
    )
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("g", 12)])
    assert len(streamer.metrics.layers()) == LAYERS  # only f's: g's blocks are not known
    streamer.add_blocks("g", [4, 7])  # blocks 1 and 2 of the prompt: 1 -> 4, 2 -> 5
    assert outcomes_until(streamer, 1) == [transfer.Outcome("g", True)]
    landed, _, dump, _ = decode.wait("g")
    assert landed and landed_blocks(dump, 4) == expected(4)
    assert landed_blocks(dump, 5) == expected(7)


def test_requests_of_one_step_coalesce_into_runs_consecutive_on_both_sides(decode, streamer):
    """Two requests whose blocks are consecutive on both sides, signalled together, are one
    run per cache: the layer's submit carries 2 copies, not 4."""
    dest = streamer.connect(decode.described)
    for request, src, dst in (("x", [0, 1], [2, 3]), ("y", [2, 3], [4, 5])):
        streamer.add_request(request, src, 8)
        streamer.set_destination(request, dest, dst, decode.expect(request))
    streamer.layer_ready(0, [("x", 8), ("y", 8)])
    assert transfer.block_runs([0, 1, 2, 3], [2, 3, 4, 5]) == [(0, 2, 4)]
    for layer in range(1, LAYERS):
        streamer.layer_ready(layer, [("x", 8), ("y", 8)])
    assert sorted(o.request_id for o in outcomes_until(streamer, 2)) == ["x", "y"]
    records = streamer.metrics.layers()
    assert [r.requests for r in records] == [2] * LAYERS
    assert all(r.nbytes == CACHES * 4 * BLOCK_BYTES for r in records)
    for request in ("x", "y"):
        assert decode.wait(request)[0]


def test_block_runs_pair_only_blocks_consecutive_on_both_sides():
    assert transfer.block_runs([0, 1, 2, 5], [10, 11, 3, 4]) == [(0, 10, 2), (2, 3, 1), (5, 4, 1)]


def test_a_killed_decode_process_fails_its_transfers_on_the_prefill_side(streamer, namespace):
    """SIGKILL the decode process mid-transfer: its requests end as failed (naming it) at
    the next poll or layer, the other decode process's transfer still lands, and what the
    dead one leaves is exactly its own memory (7 regions, 7 records), which pdhal's
    cleanup reclaims."""
    doomed, other = Decode("doomed"), Decode("other")
    try:
        for request, decode in (("doomed", doomed), ("kept", other)):
            streamer.add_request(request, [0, 1], 8)
            streamer.set_destination(
                request, streamer.connect(decode.described), [0, 1], decode.expect(request)
            )
        streamer.layer_ready(0, [("doomed", 8), ("kept", 8)])
        doomed.kill()
        for layer in range(1, LAYERS):
            streamer.layer_ready(layer, [("doomed", 8), ("kept", 8)])
        ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
        assert not ended["doomed"].landed and "is gone" in ended["doomed"].reason
        assert ended["kept"].landed and other.wait("kept")[0]
        deadline = time.monotonic() + 60  # the streamer lets go of the dead one's memory
        while "buf.doomed." in open("/proc/self/maps").read():
            assert time.monotonic() < deadline, "the dead decode side's caches stay mapped"
            streamer.poll()
            time.sleep(0.01)
        removed, _ = pdhal.cleanup(namespace)
        names = sorted(os.path.basename(path).split(".", 3)[3] for path in removed)
        assert len(names) == 2 * (LAYERS * CACHES + 1), names
        assert all(n.startswith(("buf.doomed.", f"buf.host.{doomed.proc.pid}.")) for n in names), (
            names
        )
        # a new decode process is served at once; nothing else restarts
        again = Decode("again")
        try:
            streamer.add_request("again", [4, 5], 8)
            streamer.set_destination(
                "again", streamer.connect(again.described), [6, 7], again.expect("again")
            )
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [("again", 8)])
            assert outcomes_until(streamer, 1) == [transfer.Outcome("again", True)]
            landed, _, dump, _ = again.wait("again")
            assert landed and landed_blocks(dump, 7) == expected(5)
        finally:
            again.close()
    finally:
        other.close()


PREFILL = f"""
import json, sys, time
import numpy as np
from pdhal import transfer
L, C, B, BB = {LAYERS}, {CACHES}, {BLOCKS}, {BLOCK_BYTES}
described, ticket = json.loads(sys.stdin.readline())
caches = [[np.full((B, BB), 9, np.uint8) for _ in range(C)] for _ in range(L)]
streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(caches), {BLOCK_TOKENS})
streamer.add_request("r", [0, 1], 8)
streamer.set_destination("r", streamer.connect(described), [0, 1], ticket)
streamer.layer_ready(0, [("r", 8)])
while not streamer.metrics.layers():  # its write runs on the destination's thread
    time.sleep(0.001)
print("layer 0 sent", flush=True)
sys.stdin.readline()  # killed here
"""


def test_a_killed_prefill_process_fails_the_transfer_on_the_decode_side_by_its_deadline(decode):
    """SIGKILL the prefill side after its first layer: the decode side never sees the
    request as landed; it ends as failed when its deadline passes."""
    ticket = decode.expect("r", timeout=1.0)
    prefill = python_child(PREFILL, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prefill.stdin.write(json.dumps([decode.described, ticket]) + "\n")
    prefill.stdin.flush()
    assert prefill.stdout.readline().strip() == "layer 0 sent"
    prefill.send_signal(signal.SIGKILL)
    prefill.wait(timeout=30)
    prefill.stdin.close()
    prefill.stdout.close()
    landed, reason, dump, _ = decode.wait("r")
    assert not landed and "nothing landed within 1 s" in reason
    assert landed_blocks(dump, 0)[0] == [9, 9], "layer 0 had landed: the decode side saw it"
    assert landed_blocks(dump, 0)[1] == [0, 0]


def test_a_request_nobody_claims_fails_by_its_lease():
    layout = transfer.CacheLayout.from_caches(source_caches())
    streamer = transfer.KVStreamer(layout, BLOCK_TOKENS, claim_timeout=0.05)
    try:
        streamer.add_request("orphan", [0], 4)
        streamer.layer_ready(0, [("orphan", 4)])
        ended = outcomes_until(streamer, 1)
        assert ended[0].request_id == "orphan" and not ended[0].landed
        assert "no decode side claimed it within 0.05 s" in ended[0].reason
        assert streamer.pending() == 0
    finally:
        streamer.close()


def test_a_failure_the_prefill_side_reports_reaches_the_decode_side_with_its_reason(
    decode, streamer
):
    assert "f" not in streamer
    streamer.add_request("f", [0, 1], 8)
    assert "f" in streamer  # added, not ended
    streamer.set_destination("f", streamer.connect(decode.described), [0, 1], decode.expect("f"))
    streamer.layer_ready(0, [("f", 8)])
    streamer.fail("f", "the prefill worker died: ProducerDiedError")
    assert outcomes_until(streamer, 1) == [
        transfer.Outcome("f", False, "the prefill worker died: ProducerDiedError")
    ]
    assert "f" not in streamer  # reported: ended
    landed, reason, _, _ = decode.wait("f")
    assert not landed and reason == "the prefill worker died: ProducerDiedError"
    streamer.layer_ready(1, [("f", 8)])  # an ended request's later layers go nowhere
    assert streamer.poll() == []


def test_layouts_that_do_not_pair_up_are_refused_before_anything_moves(decode):
    fewer = transfer.CacheLayout.from_caches(source_caches()[:2])
    streamer = transfer.KVStreamer(fewer, BLOCK_TOKENS)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match="3 layers .* this side 2"):
            streamer.connect(decode.described)
    finally:
        streamer.close()


def test_bad_requests_are_refused_with_what_was_expected(decode, streamer):
    """Everything a request is given is checked when it is given, so a bad one never fails
    the requests sent with it."""
    bad = pdhal.InvalidArgumentError
    with pytest.raises(bad, match="needs 3 source blocks; 0 given, then 4 more"):
        streamer.add_request("long", [0, 1, 2, 3], 10)
    with pytest.raises(bad, match="4 cached blocks leave nothing of a prompt of 10 tokens"):
        streamer.add_request("cached", [], 10, cached_blocks=4)
    with pytest.raises(bad, match="src_blocks.0. is block 8, outside the prefill caches' 8 blocks"):
        streamer.add_request("far", [8], 4)
    with pytest.raises(bad, match="request_id must be a non-empty str"):
        streamer.add_request("", [0], 4)
    for unordered in ({0}, {0: 1}, np.array(0)):  # a set's or dict's order is no prompt's
        with pytest.raises(bad, match="src_blocks must be a list of block ids"):
            streamer.add_request("unordered", unordered, 4)
    streamer.add_request("ok", [0], 4)
    with pytest.raises(bad, match="was added already"):
        streamer.add_request("ok", [1], 4)
    with pytest.raises(bad, match=r"layer must be an int in \[0, 2\], got 3"):
        streamer.layer_ready(3, [("ok", 4)])
    with pytest.raises(bad, match="tokens must be an int >= 0"):
        streamer.layer_ready(0, [("ok", "4")])
    with pytest.raises(bad, match=r"ready must be \(request_id, tokens\) pairs"):
        streamer.layer_ready(0, [5])
    with pytest.raises(bad, match="dest must come from this streamer's connect"):
        streamer.set_destination("ok", None, [0], {})
    dest = streamer.connect(decode.described)
    ticket = decode.expect("ok")
    with pytest.raises(bad, match="the ticket's slot must be an int"):
        streamer.set_destination("ok", dest, [0], dict(ticket, slot="x"))
    with pytest.raises(bad, match=r"the ticket's slot must be an int in \[0, 7\], got 8"):
        streamer.set_destination("ok", dest, [0], dict(ticket, slot=8))
    with pytest.raises(bad, match="4 tokens from block 0 on are 1 destination blocks, got 2"):
        streamer.set_destination("ok", dest, [0, 1], ticket)
    with pytest.raises(bad, match="needs 5 tokens from block 0 on; the prompt has 4 tokens"):
        streamer.set_destination("ok", dest, [0], ticket, tokens=5)
    with pytest.raises(bad, match="needs 4 tokens from block 1 on"):
        streamer.set_destination("ok", dest, [], ticket, cached_blocks=1)
    with pytest.raises(bad, match="needs 1 source blocks; 1 given, then 1 more"):
        streamer.add_blocks("ok", [3])
    with pytest.raises(bad, match="dst_blocks.0. is block 9, outside the decode caches' 8 blocks"):
        streamer.set_destination("ok", dest, [9], ticket)
    with pytest.raises(bad, match="unknown"):
        streamer.set_destination("nobody", dest, [0], ticket)
    with pytest.raises(bad, match="described lacks layout"):
        streamer.connect({"transport": "shm"})
    layout = transfer.CacheLayout.from_caches(source_caches())
    with pytest.raises(bad, match=r"stall_timeout must be in \(0, 86400\] seconds, got inf"):
        transfer.KVStreamer(layout, BLOCK_TOKENS, stall_timeout=float("inf"))
    with pytest.raises(bad, match="block_tokens must be an int >= 1"):
        transfer.KVStreamer(layout, True)
    streamer.set_destination("ok", dest, [0], ticket)  # all good: it goes, and lands
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("ok", 4)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("ok", True)]
    assert decode.wait("ok")[0]
    streamer.close()
    with pytest.raises(pdhal.ClosedHandleError, match="the streamer was closed"):
        streamer.add_request("late", [0], 4)


def test_a_request_id_used_again_sends_its_own_blocks_and_its_slot_holds_no_old_reason(
    decode, streamer
):
    """An engine that retries a request under the same id, with other blocks, gets those
    blocks (a plan of the first one is not reused), and a status slot used again holds
    nothing of its last request (the reason of a failure there)."""
    dest = streamer.connect(decode.described)
    streamer.add_request("r", [0, 1], 8)
    first = decode.expect("r")
    streamer.set_destination("r", dest, [2, 3], first)
    streamer.layer_ready(0, [("r", 8)])
    streamer.fail("r", "first try given up")
    assert outcomes_until(streamer, 1)[0].reason == "first try given up"
    assert decode.wait("r")[1] == "first try given up"
    streamer.add_request("r", [4, 5], 8)
    # a slot that came free is handed out after every other one (8 slots)
    others = [decode.expect(f"pad{i}")["slot"] for i in range(7)]
    assert first["slot"] not in others
    ticket = decode.expect("r")  # the same slot, with the next generation
    assert ticket["slot"] == first["slot"] and ticket["generation"] > first["generation"]
    streamer.set_destination("r", dest, [6, 7], ticket)
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("r", 8)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("r", True)]
    landed, reason, dump, _ = decode.wait("r")
    assert landed and reason == ""
    assert landed_blocks(dump, 6) == expected(4) and landed_blocks(dump, 7) == expected(5)


def test_layouts_with_a_stride_copy_block_by_block():
    """A cache whose blocks are not contiguous (stride > block bytes) copies each block on
    its own; contiguous ones coalesce; runs past either side are refused."""
    region = np.zeros(4 * 32, np.uint8)
    spaced = transfer.CacheLayout([region], [[transfer.CacheSpec(0, 0, 32, 16, 4)]])
    packed = transfer.CacheLayout([region], [[transfer.CacheSpec(0, 0, 16, 16, 8)]])
    base = region.ctypes.data
    assert transfer.RunPlanner(spaced, packed.layers).copies(0, [(1, 2, 2)]) == [
        (base + 32, 0, 32, 16),
        (base + 64, 0, 48, 16),
    ]
    into_packed = transfer.RunPlanner(packed, packed.layers)
    assert into_packed.copies(0, [(1, 2, 2)]) == [(base + 16, 0, 32, 32)]
    with pytest.raises(pdhal.InvalidArgumentError, match="ends at byte 144 of region 0"):
        transfer.CacheLayout([region], [[transfer.CacheSpec(0, 32, 32, 16, 4)]])


def test_the_numbers_export_as_json_and_prometheus_text(decode, streamer):
    streamer.add_request("m", [0], 4)
    streamer.set_destination("m", streamer.connect(decode.described), [0], decode.expect("m"))
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("m", 4)], signal_ns=time.monotonic_ns())
    outcomes_until(streamer, 1)
    decoded = json.loads(streamer.metrics.to_json())
    assert decoded["snapshot"]["layers_landed"] == LAYERS
    assert [r["layer"] for r in decoded["layers"]] == list(range(LAYERS))
    for r in decoded["layers"]:
        assert r["signal_ns"] <= r["submit_ns"] <= r["end_ns"] and r["landed"]
    text = streamer.metrics.to_prometheus()
    assert "# TYPE pdhal_transfer_bytes_landed_total counter" in text
    assert f"pdhal_transfer_bytes_landed_total {LAYERS * CACHES * BLOCK_BYTES}" in text
    assert "pdhal_transfer_exposed_ms_p50 " in text
    decode.wait("m")


def test_transports_are_listed_and_an_unknown_one_is_named():
    assert "shm" in transfer.transports()
    with pytest.raises(pdhal.InvalidArgumentError, match="no transport named 'carrier-pigeon'"):
        transfer.transport("carrier-pigeon")


def test_a_status_slot_reads_only_its_own_generation():
    """What a late write of an earlier request leaves in a slot is not the current one's:
    a word of another generation is pending, a reason of another generation is not read."""
    from pdhal._transfer import mailbox

    slot = bytearray(mailbox.SLOT_BYTES)
    slot[mailbox.REASON_AT :] = mailbox.reason_bytes(1, "old news")
    slot[:8] = mailbox.word(2, mailbox.FAILED)
    state, reason = mailbox.read(memoryview(slot), 2)
    assert state == mailbox.FAILED and "old news" not in reason
    assert mailbox.read(memoryview(slot), 3) == (mailbox.PENDING, "")
    slot[mailbox.REASON_AT :] = mailbox.reason_bytes(2, "its own")
    assert mailbox.read(memoryview(slot), 2) == (mailbox.FAILED, "its own")
    slot[:8] = mailbox.word(4, mailbox.LANDED)
    assert mailbox.read(memoryview(slot), 4) == (mailbox.LANDED, "")


def test_a_layerwise_ticket_hears_each_layer_as_it_lands_and_only_then(decode, streamer):
    """A decode side that computes layer by layer (vLLM's sync load): after the first two
    of three layers were signalled it hears 2 layers landed, and their blocks are there,
    the third layer's not; a plain ticket hears 0 until the outcome; a failure raises."""
    dest = streamer.connect(decode.described)
    streamer.add_request("lw", [1, 2], 8)
    streamer.set_destination("lw", dest, [4, 5], decode.expect("lw", layerwise=True))
    streamer.add_request("plain", [3], 4)
    streamer.set_destination("plain", dest, [6], decode.expect("plain"))
    for layer in range(LAYERS - 1):
        streamer.layer_ready(layer, [("lw", 8), ("plain", 4)])
    landed, dump = decode.layers_until("lw", LAYERS - 1)
    assert landed == LAYERS - 1
    for src, dst in ((1, 4), (2, 5)):
        assert landed_blocks(dump, dst)[: LAYERS - 1] == expected(src)[: LAYERS - 1]
        assert landed_blocks(dump, dst)[LAYERS - 1] == [0] * CACHES  # not signalled yet
    assert decode.layers("plain")[0] == 0
    streamer.layer_ready(LAYERS - 1, [("lw", 8), ("plain", 4)])
    assert sorted(o.request_id for o in outcomes_until(streamer, 2)) == ["lw", "plain"]
    assert decode.layers_until("lw", LAYERS)[0] == LAYERS
    assert decode.wait("lw")[0] and decode.wait("plain")[0]
    assert decode.layers("lw") == [None, "InvalidArgumentError: request 'lw' is not expected"]

    streamer.add_request("doomed", [0], 4)
    streamer.set_destination("doomed", dest, [7], decode.expect("doomed", layerwise=True))
    streamer.layer_ready(0, [("doomed", 4)])
    assert decode.layers_until("doomed", 1)[0] == 1
    streamer.fail("doomed", "the prefill worker died")
    assert outcomes_until(streamer, 1) == [
        transfer.Outcome("doomed", False, "the prefill worker died")
    ]
    deadline = time.monotonic() + 30
    while (answer := decode.layers("doomed"))[0] is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert answer == [None, "TransferError: the prefill worker died"]


def test_outcomes_can_go_to_a_callback_and_records_to_a_cursor(decode, caplog):
    """A messager blocked on the next signal hears each outcome through on_outcome (poll()
    then has none); an exporter reads each layer record once, with the step it was told;
    a callback that raises is logged, and the next outcome still comes."""
    heard = []

    def on_outcome(outcome):
        heard.append(outcome)
        if outcome.request_id == "first":
            raise RuntimeError("a callback's own bug")

    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, on_outcome=on_outcome
    )
    try:
        dest = streamer.connect(decode.described)
        mark = 0
        for step, request in enumerate(("first", "second")):
            streamer.add_request(request, [step], 4)
            streamer.set_destination(request, dest, [step + 2], decode.expect(request))
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [(request, 4)], step=10 + step)
            deadline = time.monotonic() + 30
            while len(heard) <= step and time.monotonic() < deadline:
                time.sleep(0.005)
            records, mark = streamer.metrics.layers_since(mark)
            assert [(r.step, r.layer) for r in records] == [(10 + step, n) for n in range(LAYERS)]
            assert decode.wait(request)[0]
        assert heard == [transfer.Outcome("first", True), transfer.Outcome("second", True)]
        assert "on_outcome raised" in caplog.text and "a callback's own bug" in caplog.text
        assert streamer.poll() == [] and streamer.metrics.layers_since(mark) == ([], mark)
        with pytest.raises(pdhal.InvalidArgumentError, match=r"step must be an int in \[0, "):
            streamer.layer_ready(0, [], step=-1)
    finally:
        streamer.close()
    with pytest.raises(pdhal.InvalidArgumentError, match="on_outcome must be callable"):
        transfer.KVStreamer(transfer.CacheLayout.from_caches(source_caches()), 4, on_outcome=1)
