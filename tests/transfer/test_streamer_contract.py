"""KVStreamer's contract against a careless engine: each value is checked at the call that
gives it (a bad one fails that call alone, never a later layer or another request), a ticket
is bound to its request and its receiver, LANDED means every layer's bytes are in the decode
process (layer-wise progress counts only the first layers that all landed), every request
ends once within its bound with no caller held by a slow decode side, and leases and dead
peers are kept by the streamer's own clock. The decode side is another process."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import pdhal
from pdhal import ops, transfer
from pdhal._transfer import plugins as _transports
from pdhal._transfer.shm import _start_time
from pdhal.testing import ManualClock
from pdhal.testing.fixtures import python_child
from pdhal.testing.transfer_peers import (
    BLOCK_TOKENS,
    LAYERS,
    Decode,
    Prefill,
    expected,
    landed_blocks,
    mapped_from,
    outcomes_until,
    source_caches,
)


def make_streamer(**options) -> transfer.KVStreamer:
    options.setdefault("claim_timeout", 30)
    return transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, **options
    )


@pytest.fixture
def streamer():
    s = make_streamer()
    yield s
    s.close()


def stream_whole(streamer, request_id, tokens):
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [(request_id, tokens)])


def test_a_ticket_is_bound_to_its_request_and_to_its_receiver(decode, streamer):
    """Request b's ticket given for a, or a ticket of another receiver: refused at the call,
    so no decode side is told that a request landed with none of its bytes written."""
    other = Decode("other")
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("a", [0], 4)
        ticket_b = decode.expect("b")
        with pytest.raises(pdhal.InvalidArgumentError, match="ticket is for request 'b', not 'a'"):
            streamer.set_destination("a", dest, [1], ticket_b)
        foreign = other.expect("a")
        with pytest.raises(pdhal.InvalidArgumentError, match="comes from another receiver"):
            streamer.set_destination("a", dest, [1], foreign)
        streamer.set_destination("a", dest, [1], decode.expect("a"))  # its own: it goes
        stream_whole(streamer, "a", 4)
        assert outcomes_until(streamer, 1) == [transfer.Outcome("a", True)]
        landed, _, dump, _ = decode.wait("a")
        assert landed and landed_blocks(dump, 1) == expected(0)
    finally:
        other.close()


def test_poll_waits_for_the_next_outcome(decode, streamer):
    """The decode side may read LANDED a moment before the streamer hears its last write
    settle: poll(timeout) waits for the outcome (woken by it), [] if none came, and a
    timeout that is no number of seconds is refused."""
    dest = streamer.connect(decode.described)
    streamer.add_request("a", [0], 4)
    streamer.set_destination("a", dest, [0], decode.expect("a"))
    assert streamer.poll(timeout=0.05) == []
    sender = threading.Timer(0.2, stream_whole, (streamer, "a", 4))
    sender.start()
    assert streamer.poll(timeout=60) == [transfer.Outcome("a", True)]
    sender.join()
    for bad in (-1, "1", True, float("nan"), 10**6):
        with pytest.raises(pdhal.InvalidArgumentError, match="timeout must be"):
            streamer.poll(timeout=bad)


def test_destination_blocks_named_twice_are_refused(decode, streamer):
    dest = streamer.connect(decode.described)
    streamer.add_request("a", [0, 1], 8)
    with pytest.raises(pdhal.InvalidArgumentError, match=r"dst_blocks names block\(s\) \[3\]"):
        streamer.set_destination("a", dest, [3, 3], decode.expect("a"))


def test_numpy_block_ids_are_ids_and_a_bad_request_fails_only_its_own_call(decode, streamer):
    """Block ids from a numpy array (as engines keep block tables) are converted once; a
    call with a bad value is refused there, and the requests sent in the same layer land."""
    dest = streamer.connect(decode.described)
    streamer.add_request("np", np.array([2, 3], np.int64), 8)
    streamer.set_destination("np", dest, np.array([5, 6], np.int32), decode.expect("np"))
    streamer.add_request("ok", [4], 4)
    streamer.set_destination("ok", dest, [7], decode.expect("ok"))
    bad = pdhal.InvalidArgumentError
    with pytest.raises(bad, match="signal_ns must be an int"):
        streamer.layer_ready(0, [("np", 8)], signal_ns="now")
    with pytest.raises(bad, match=r"ready\[0\]'s request_id must be a non-empty str"):
        streamer.layer_ready(0, [(["unhashable"], 8)])
    with pytest.raises(bad, match=r"src_blocks\[0\] must be a block id"):
        streamer.add_request("none", [None], 4)
    with pytest.raises(bad, match=r"the ticket's generation must be an int in \[1, 7205"):
        streamer.add_request("far", [1], 4)
        streamer.set_destination("far", dest, [0], dict(decode.expect("far"), generation=1 << 60))
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("np", np.int64(8)), ("ok", 4)])
    ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
    assert ended["np"].landed and ended["ok"].landed
    landed, _, dump, _ = decode.wait("np")
    assert landed and landed_blocks(dump, 5) == expected(2)
    assert landed_blocks(dump, 6) == expected(3)
    assert decode.wait("ok")[0]
    assert "far" in streamer  # refused at set_destination: still waiting for a good one


def test_layerwise_progress_counts_only_the_first_layers_that_all_landed(decode, streamer):
    """The engine signals layer 1 before layer 0: a decode side computing layer by layer
    must hear 0 layers landed until layer 0 is there too, never 1 with layer 0 zeros."""
    dest = streamer.connect(decode.described)
    streamer.add_request("lw", [1], 4)
    streamer.set_destination("lw", dest, [2], decode.expect("lw", layerwise=True))
    streamer.layer_ready(1, [("lw", 4)])
    deadline = time.monotonic() + 30
    while not streamer.metrics.layers():
        assert time.monotonic() < deadline, "layer 1 never landed"
        time.sleep(0.005)
    assert decode.block(1, 0, 2)[0] == expected(1)[1][0], "layer 1 landed"
    assert decode.layers("lw")[0] == 0
    streamer.layer_ready(0, [("lw", 4)])
    while (landed := decode.layers("lw")[0]) < 2:
        assert time.monotonic() < deadline, f"layers_landed stays {landed}"
        time.sleep(0.005)
    _, dump = decode.layers("lw")
    assert landed_blocks(dump, 2)[:2] == expected(1)[:2]
    streamer.layer_ready(2, [("lw", 4)])
    assert outcomes_until(streamer, 1) == [transfer.Outcome("lw", True)]
    assert decode.wait("lw")[0]


def test_a_reused_slot_reports_none_of_the_last_request_s_layers(decode, streamer):
    """A layerwise request got 2 layers landed, then failed; its slot, handed out again
    (after the other 7), must report 0 layers for the new request, not the old 2."""
    dest = streamer.connect(decode.described)
    streamer.add_request("old", [0], 4)
    first = decode.expect("old", layerwise=True)
    streamer.set_destination("old", dest, [0], first)
    streamer.layer_ready(0, [("old", 4)])
    streamer.layer_ready(1, [("old", 4)])
    deadline = time.monotonic() + 30
    while decode.layers("old")[0] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    streamer.fail("old", "given up")
    assert not decode.wait("old")[0]
    for i in range(7):
        decode.expect(f"pad{i}")
    ticket = decode.expect("new", layerwise=True)
    assert ticket["slot"] == first["slot"]
    assert decode.layers("new")[0] == 0


def test_a_request_whose_source_blocks_never_come_fails_by_its_lease(decode):
    """add_request with the first of 3 blocks, the prompt whole in every layer, and
    add_blocks never called: failed claim_timeout after the prompt was whole (not a moment
    before), on both sides, not pending forever; the streamer is never polled (outcomes by
    on_outcome), so its own clock keeps the lease."""
    heard, clock = queue.SimpleQueue(), ManualClock()
    streamer = make_streamer(claim_timeout=60, on_outcome=heard.put, clock=clock)
    try:
        dest, ticket = streamer.connect(decode.described), decode.expect("short", timeout=600)
        streamer.add_request("short", [0], 12)
        streamer.set_destination("short", dest, [1, 2, 3], ticket)
        stream_whole(streamer, "short", 12)
        clock.advance(59.999)
        with pytest.raises(queue.Empty):  # (its lease job has not run: nothing to come)
            heard.get(timeout=0.5)
        clock.advance(0.001)
        outcome = heard.get(timeout=30)  # told once its FAILED word is written
        assert not outcome.landed and "not all its source blocks were given" in outcome.reason
        assert "within 60 s" in outcome.reason
        landed, reason, _, _ = decode.wait("short")
        assert not landed and "source blocks" in reason
    finally:
        streamer.close()


def test_a_request_nobody_claims_fails_at_its_claim_lease_exactly():
    """A request no decode side is set for fails claim_timeout after add_request, not a
    moment before, with the lease in its reason. (A clock that is not a Clock is refused
    at the call.)"""
    with pytest.raises(pdhal.InvalidArgumentError, match="clock must be a pdhal.transfer.Clock"):
        make_streamer(clock=time.monotonic)
    clock = ManualClock()
    streamer = make_streamer(claim_timeout=60, clock=clock)
    try:
        streamer.add_request("orphan", [0, 1], 8)
        clock.advance(30)
        streamer.add_request("later", [2], 4)
        clock.advance(29.999)
        assert streamer.poll() == []
        clock.advance(0.001)
        assert streamer.poll() == [
            transfer.Outcome("orphan", False, "no decode side claimed it within 60 s")
        ]
        clock.advance(30)
        assert [o.request_id for o in streamer.poll()] == ["later"]
    finally:
        streamer.close()


def test_a_claimed_request_fails_at_its_decode_side_s_deadline(decode):
    """A request claimed with a ticket of 20 s whose layers never come fails on the
    prefill side when that deadline passes on its clock, not before, and its decode side
    reads why (it is not left to find out by its own timeout)."""
    clock = ManualClock()
    streamer = make_streamer(clock=clock)
    try:
        streamer.add_request("slow", [0], 4)
        streamer.set_destination(
            "slow", streamer.connect(decode.described), [1], decode.expect("slow", timeout=20)
        )
        clock.advance(19.99)
        assert streamer.poll(timeout=0.5) == []  # (its deadline job has not run)
        clock.advance(0.01)
        [outcome] = outcomes_until(streamer, 1)  # once its FAILED word is written
        assert not outcome.landed and "its decode side's deadline (20 s) passed" in outcome.reason
        landed, reason, _, _ = decode.wait("slow")
        assert not landed and "deadline" in reason
    finally:
        streamer.close()


def test_leases_and_dead_peers_are_kept_without_any_poll(decode, namespace):
    """A messager hearing outcomes through on_outcome never polls: a request nobody claims
    still fails by its lease (a streamer holding nothing else, its clock moved on), and
    one whose decode process was killed by the streamer's peer check, which then lets go
    of that process's memory (its caches stay in RAM while anything maps them)."""
    heard, clock = [], ManualClock()
    leases = make_streamer(claim_timeout=60, on_outcome=heard.append, clock=clock)
    streamer = make_streamer(on_outcome=heard.append)
    try:
        leases.add_request("orphan", [0], 4)
        clock.advance(60)
        streamer.add_request("doomed", [1, 2], 8)
        streamer.set_destination(
            "doomed", streamer.connect(decode.described), [0, 1], decode.expect("doomed")
        )
        streamer.layer_ready(0, [("doomed", 8)])
        decode.kill()
        deadline = time.monotonic() + 30
        while len(heard) < 2:
            assert time.monotonic() < deadline, f"only {heard}"
            time.sleep(0.01)
        ended = {o.request_id: o for o in heard}
        assert "no decode side claimed it within 60 s" in ended["orphan"].reason
        assert not ended["doomed"].landed and "is gone" in ended["doomed"].reason
        while mapped_from(decode.proc.pid):
            assert time.monotonic() < deadline, "the gone decode side's caches stay mapped"
            time.sleep(0.01)
    finally:
        leases.close()
        streamer.close()
        pdhal.cleanup(namespace)  # what the killed decode process left


def test_a_decode_side_connected_twice_at_once_keeps_one_link(decode, monkeypatch):
    """Two threads connect the same decode side at once, each making a link (held until
    both are made): both get the one destination, and the other link is closed, so none
    of the decode side stays mapped once the streamer is closed."""
    streamer = make_streamer()
    both, made = threading.Barrier(2, timeout=30), streamer._transport.connect

    def connect_together(described, sources):
        link = made(described, sources)
        both.wait()
        return link

    monkeypatch.setattr(streamer._transport, "connect", connect_together)
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(streamer.connect(decode.described)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(got) == 2 and got[0] is got[1]
    streamer.close()
    deadline = time.monotonic() + 30
    while mapped_from(decode.proc.pid):  # the other link's threads end on their own
        assert time.monotonic() < deadline, "the link that lost the race is never closed"
        time.sleep(0.01)


@pytest.mark.parametrize("transport_name", ["shm", "faulty"])
def test_close_tells_every_pending_decode_side(decode, request, transport_name):
    """close() with requests half sent: each decode side reads FAILED with the reason in
    its slot (not by its own deadline, 60 s away), and the streamer reports each once. Over
    shm, which posts (a settle's word is submitted on the settling thread), and over shm
    without that (`faulty` with no fault: every write through the submitting thread)."""
    if transport_name == "faulty":
        request.getfixturevalue("faulty")("")
    streamer = make_streamer(transport_name=transport_name)
    dest = streamer.connect(decode.described)
    for n in range(3):
        streamer.add_request(f"r{n}", [n], 4)
        streamer.set_destination(f"r{n}", dest, [n], decode.expect(f"r{n}", timeout=60))
        streamer.layer_ready(0, [(f"r{n}", 4)])
    streamer.close()
    assert sorted(streamer.poll(), key=lambda o: o.request_id) == [
        transfer.Outcome(f"r{n}", False, "the streamer was closed") for n in range(3)
    ]
    for n in range(3):
        landed, reason, _, _ = decode.wait(f"r{n}")
        assert not landed and reason == "the streamer was closed"


def test_no_caller_waits_on_a_stalled_decode_side(decode, faulty):
    """Every write to the decode side stalls (stall_timeout 5 s): layer_ready, fail and
    abort with 8 requests in flight (every slot the decode side has) return before any
    write settled; close() then ends each request once, failed."""
    faults = faulty
    faults("stalls:1")
    streamer = make_streamer(transport_name="faulty", stall_timeout=5)
    try:
        dest = streamer.connect(decode.described)
        for n in range(8):
            streamer.add_request(f"r{n}", [n % 8], 4)
            streamer.set_destination(f"r{n}", dest, [n % 8], decode.expect(f"r{n}", timeout=60))
        for layer in range(LAYERS - 1):  # the last layer to come: abort fails them all
            streamer.layer_ready(layer, [(f"r{n}", 4) for n in range(8)])
        streamer.fail("r0", "given up")
        streamer.abort("the prefill worker died")
        assert streamer.metrics.layers() == [], "a caller waited for a stalled write"
        assert streamer.poll() == [] and streamer.pending() == 8
    finally:
        closer = threading.Thread(target=streamer.close)
        closer.start()
    closer.join(timeout=150)
    assert not closer.is_alive()
    assert sorted(o.request_id for o in streamer.poll()) == sorted(f"r{n}" for n in range(8))


def test_a_stall_breaks_its_decode_side_as_a_whole_and_the_next_request_lands(decode, faulty):
    """The first two writes to the decode side stall past stall_timeout: every request in
    flight there fails (naming the stall), and requests sent after it land on both sides,
    again and again (a stall that passed leaves nothing poisoned: 70 requests after it,
    more than any pool of status buffers)."""
    faulty("stall:1,stall:2")
    streamer = make_streamer(transport_name="faulty", stall_timeout=0.3)
    try:
        dest = streamer.connect(decode.described)
        for request, block in (("a", 0), ("b", 1)):
            streamer.add_request(request, [block], 4)
            streamer.set_destination(request, dest, [block], decode.expect(request, timeout=2))
            streamer.layer_ready(0, [(request, 4)])
        ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
        assert all(not o.landed and "injected stall" in o.reason for o in ended.values())
        for request in ("a", "b"):
            assert not decode.wait(request)[0]
        for n in range(70):
            request = f"after{n}"
            streamer.add_request(request, [n % 8], 4)
            streamer.set_destination(request, dest, [n % 8], decode.expect(request))
            stream_whole(streamer, request, 4)
            assert outcomes_until(streamer, 1) == [transfer.Outcome(request, True)]
            landed, reason, dump, _ = decode.wait(request)
            assert landed, reason
            assert landed_blocks(dump, n % 8) == expected(n % 8)
    finally:
        streamer.close()


def test_a_connect_that_never_returns_after_a_break_still_ends_every_request(decode, faulty):
    """A write stalls and breaks the decode side; connecting to it again never returns (the
    link is cut: Mooncake's connect blocks for minutes). Each request still ends, failed,
    within about 2 x stall_timeout (its failure's word cannot go: the connect is given up
    after stall_timeout), and the streamer closes within its bound."""
    faulty("stall:1,hangs:2")
    streamer = make_streamer(transport_name="faulty", stall_timeout=0.5)
    try:
        dest = streamer.connect(decode.described)
        for request, block in (("a", 0), ("b", 1)):
            streamer.add_request(request, [block], 4)
            streamer.set_destination(request, dest, [block], decode.expect(request, timeout=60))
        streamer.layer_ready(0, [("a", 4), ("b", 4)])
        ended = {o.request_id: o for o in outcomes_until(streamer, 2, bound=30)}
        assert sorted(ended) == ["a", "b"]
        assert all(not o.landed for o in ended.values())
        streamer.add_request("c", [2], 4)  # after the break: its connect is tried anew
        streamer.set_destination("c", dest, [2], decode.expect("c", timeout=60))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("c", 4)])
        [c] = outcomes_until(streamer, 1, bound=30)
        assert not c.landed and "did not finish within 0.5 s" in c.reason, c
    finally:
        closer = threading.Thread(target=streamer.close)
        closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive()


def test_a_transport_whose_problem_raises_still_reports_what_landed(decode, faulty):
    """A link whose problem() raises (a transport's bug) is a broken decode side for the
    requests there, never an exception out of poll(); another decode side's request over
    a healthy link lands."""
    faulty("problem:1@doomed")
    doomed, healthy = Decode("doomed"), Decode("healthy")
    streamer = make_streamer(transport_name="faulty")
    try:
        for request, peer in (("d", doomed), ("h", healthy)):
            streamer.add_request(request, [0], 4)
            streamer.set_destination(
                request, streamer.connect(peer.described), [0], peer.expect(request, timeout=5)
            )
        ended = {}
        while "d" not in ended:
            ended.update({o.request_id: o for o in outcomes_until(streamer, 1)})
        assert "problem() raised RuntimeError" in ended["d"].reason
        stream_whole(streamer, "h", 4)
        ended.update({o.request_id: o for o in outcomes_until(streamer, 1)})
        assert ended["h"].landed and healthy.wait("h")[0]
    finally:
        streamer.close()
        doomed.close()
        healthy.close()


def test_exposed_transfer_is_measured_from_the_engine_s_last_signal(decode, streamer):
    """The engine says when it signalled (signal_ns): the last layer 50 ms before the
    streamer saw it. Exposed transfer is landed minus that signal, so at least 50 ms,
    while the transfer itself took far less: a figure measured from the first submit
    would be near 0."""
    dest = streamer.connect(decode.described)
    streamer.add_request("m", [0], 4)
    streamer.set_destination("m", dest, [0], decode.expect("m"))
    signalled = time.monotonic_ns() - 50_000_000
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("m", 4)], signal_ns=signalled)
    outcomes_until(streamer, 1)
    snapshot = streamer.metrics.snapshot()
    assert snapshot["exposed_ms_p50"] >= 50
    records = streamer.metrics.layers()
    assert all(r.signal_ns == signalled for r in records)
    assert all(r.submit_ns - r.signal_ns >= 50_000_000 for r in records)


def test_no_write_after_give_up_a_stopped_prefill_resumed_after_the_deadline(decode):
    """The prefill process sends layer 0 of "r", then is SIGSTOPped. The decode side's
    deadline (5 s) passes: "r" is reported failed at once, but its blocks stay held
    (blocks_free False; freed() names nothing) while the prefill side may still write.
    The prefill process is resumed with layers 1 and 2 signalled: it ends the request (by
    the ticket's timeout, or landed), and only once its end arrived does freed() name "r";
    nothing is written into the blocks after that (they hold the same bytes once the
    prefill side closed)."""
    ticket = decode.expect("r", timeout=5.0)  # covers the prefill process's start, loaded
    prefill = Prefill()
    try:
        prefill.send("connect", decode.described)
        prefill.send("add", "r", [0, 1], [2, 3], ticket)
        prefill.send("layer", 0, [["r", 8]])
        deadline = time.monotonic() + 30
        while decode.block(0, 0, 2)[0] != expected(0)[0][0]:
            assert time.monotonic() < deadline, "layer 0 never landed"
            time.sleep(0.005)
        prefill.proc.send_signal(signal.SIGSTOP)
        landed, reason, blocks_free = decode.outcome("r")
        assert not landed and "nothing landed within 5 s" in reason
        assert blocks_free is False
        assert decode.freed()[0] == []  # held while the prefill side may still write
        for layer in (1, 2):
            prefill.send("layer", layer, [["r", 8]])
        prefill.proc.send_signal(signal.SIGCONT)
        while not (freed := decode.freed())[0]:
            assert time.monotonic() < deadline, "the blocks were never freed"
            time.sleep(0.005)
        names, at_release = freed
        assert names == ["r"]
        # resumed, the prefill side either sent the last layers before its clock ended the
        # request, or ended it first: either way its end came after its last write
        landed_there, why = prefill.outcomes(1)["r"]
        assert landed_there or "deadline (5 s) passed" in why
        prefill.close()  # every write of the prefill side settled
        _, after = decode.freed()
        assert landed_blocks(after, 2) == landed_blocks(at_release, 2)
        assert landed_blocks(after, 3) == landed_blocks(at_release, 3)
        assert decode.expect("r")["request"] == "r"  # its name is free again too
    finally:
        if prefill.proc.poll() is None:
            prefill.proc.send_signal(signal.SIGCONT)
            prefill.kill()


def test_a_transport_that_knows_completion_only_locally_is_refused(monkeypatch):
    """LANDED is a promise about the decode side's memory: a transport that calls a batch
    done once it is handed on here (Mooncake's legacy TCP framing did) is refused when
    the streamer is made, naming it, before any request could be reported landed."""

    class Sloppy(transfer.Transport):
        name = "sloppy"
        completion = "local"

    monkeypatch.setitem(_transports._instances, "sloppy", Sloppy())
    with pytest.raises(pdhal.TransferError, match="transport 'sloppy' declares completion 'local'"):
        make_streamer(transport_name="sloppy")


def test_the_caches_a_streamer_copies_from_cannot_be_freed_under_it():
    """A layout over host buffers: freeing one while a streamer over it is open is refused
    naming the streamer (the copies run on its own threads, at any time); after close()
    the free goes through. A streamer over memory already freed is refused when made."""
    buffers = [[ops.host_alloc(8 * 64) for _ in range(2)] for _ in range(LAYERS)]
    layout = transfer.CacheLayout.from_caches(
        [[b.as_numpy("uint8", (8, 64)) for b in row] for row in buffers]
    )
    streamer = transfer.KVStreamer(layout, BLOCK_TOKENS)
    with pytest.raises(pdhal.MemoryPinnedError, match="held by KVStreamer"):
        ops.host_free(buffers[1][0])
    streamer.close()
    ops.host_free(buffers[1][0])
    with pytest.raises(pdhal.ClosedHandleError):
        transfer.KVStreamer(layout, BLOCK_TOKENS)
    for row in buffers:
        for buffer in row:
            ops.host_free(buffer)


def test_a_stalled_status_write_fails_its_request_and_not_the_next(decode, faulty):
    """Every layer of "a" lands but its LANDED word (the link's 4th submit) stalls: "a" is
    failed on the prefill side ("the data landed but its status did not"), its decode side
    ends it by its deadline, never reading LANDED; "b", after, lands on both sides over a
    new link (no status buffer the stalled write may read is used again)."""
    faulty("stall:4")
    streamer = make_streamer(transport_name="faulty", stall_timeout=0.3)
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("a", [0], 4)
        streamer.set_destination("a", dest, [0], decode.expect("a", timeout=1))
        stream_whole(streamer, "a", 4)
        [ended] = outcomes_until(streamer, 1)
        assert not ended.landed and "the data landed but its status did not" in ended.reason
        landed, reason, _ = decode.outcome("a")
        assert not landed and "nothing landed within 1 s" in reason
        streamer.add_request("b", [1], 4)
        streamer.set_destination("b", dest, [1], decode.expect("b"))
        stream_whole(streamer, "b", 4)
        assert outcomes_until(streamer, 1) == [transfer.Outcome("b", True)]
        landed, _, dump, _ = decode.wait("b")
        assert landed and landed_blocks(dump, 1) == expected(1)
    finally:
        streamer.close()


def test_stalled_writes_in_flight_together_end_by_one_stall_timeout_not_one_each(decode, faulty):
    """Six writes in flight to a decode side that stopped answering (window 6, stall 2 s):
    each waits what is left of its own stall_timeout, so all six requests end about 2 s
    after their submits, far from the 12 s of six waits one after another."""
    faulty("stalls:1")
    streamer = make_streamer(transport_name="faulty", stall_timeout=2, max_layers_in_flight=6)
    try:
        dest = streamer.connect(decode.described)
        for n in range(6):
            streamer.add_request(f"r{n}", [n], 4)
            streamer.set_destination(f"r{n}", dest, [n], decode.expect(f"r{n}", timeout=30))
        started = time.monotonic()
        for n in range(6):
            streamer.layer_ready(0, [(f"r{n}", 4)])
        ended = outcomes_until(streamer, 6)
        assert all(not o.landed and "injected stall" in o.reason for o in ended)
        assert time.monotonic() - started < 7, "stalled writes waited one after another"
    finally:
        streamer.close()


# ---- what an attack on the first version of this contract found --------------------------


def test_a_receiver_closed_mid_transfer_is_written_no_more(decode, streamer):
    """The decode process closes its receiver (and lives on) with "r" half sent: close()
    reports "r" failed with blocks_free False (the prefill side may still write), the
    prefill side fails "r" naming the closed endpoint, and the layers signalled after the
    close never reach the decode caches."""
    dest = streamer.connect(decode.described)
    streamer.add_request("r", [0], 4)
    streamer.set_destination("r", dest, [3], decode.expect("r"))
    streamer.layer_ready(0, [("r", 4)])
    deadline = time.monotonic() + 30
    while decode.block(0, 0, 3)[0] != expected(0)[0][0]:
        assert time.monotonic() < deadline, "layer 0 never landed"
        time.sleep(0.005)
    assert decode.shut() == [["r", False, False]]
    streamer.layer_ready(1, [("r", 4)])
    streamer.layer_ready(2, [("r", 4)])
    [ended] = outcomes_until(streamer, 1)
    assert not ended.landed and "closed its endpoint" in ended.reason
    streamer.close()  # every write settled
    assert decode.block(1, 0, 3) == [0] * 64 and decode.block(2, 1, 3) == [0] * 64


def test_a_description_that_lies_is_refused_at_connect(decode, streamer):
    """A layout claiming more than its transport serves, a pid that is not the publisher's,
    names nobody publishes (refused at once, not after a wait), a description nested too
    deep to compare: each refused at connect, naming it, before anything moves."""
    good = decode.described
    bigger = json.loads(json.dumps(good))
    bigger["layout"]["regions"] = [2 * n for n in bigger["layout"]["regions"]]
    for spec in (s for caches in bigger["layout"]["layers"] for s in caches):
        spec[4] *= 2
    with pytest.raises(pdhal.InvalidArgumentError, match="claims regions of .* serves"):
        streamer.connect(bigger)
    other = dict(good, pid=os.getpid(), started=_start_time(os.getpid()))
    with pytest.raises(
        pdhal.InvalidArgumentError, match="published by pid .* not by the described"
    ):
        streamer.connect(other)
    ghost = dict(good, names=[n.replace("decode", "ghost") for n in good["names"]])
    started = time.monotonic()
    with pytest.raises(pdhal.TransferError):
        streamer.connect(ghost)
    assert time.monotonic() - started < 5, "connect waited for names nobody publishes"
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(pdhal.InvalidArgumentError, match="not JSON-able"):
        streamer.connect(dict(good, extra=deep))
    assert streamer.connect(good) is not None  # the truth still connects


def test_tickets_without_a_deadline_and_engine_times_past_78_hours_are_handled(decode, streamer):
    """A ticket without its timeout would let a request outlive its decode side's deadline:
    refused. A huge timeout is a pdhal error, not OverflowError. A signal time from a host
    up for more than 78 hours (2^48 ns) is a time like any other."""
    dest = streamer.connect(decode.described)
    streamer.add_request("r", [0], 4)
    ticket = decode.expect("r")
    with pytest.raises(pdhal.InvalidArgumentError, match="the ticket has no timeout"):
        streamer.set_destination(
            "r", dest, [0], {k: v for k, v in ticket.items() if k != "timeout"}
        )
    with pytest.raises(pdhal.InvalidArgumentError, match="the ticket's timeout must be in"):
        streamer.set_destination("r", dest, [0], dict(ticket, timeout=10**400))
    streamer.set_destination("r", dest, [0], ticket)
    late = (1 << 48) + 12345
    for layer in range(LAYERS):
        streamer.layer_ready(layer, [("r", 4)], signal_ns=late)
    assert outcomes_until(streamer, 1) == [transfer.Outcome("r", True)]


def test_close_from_on_outcome_is_refused_and_the_streamer_still_closes(decode):
    """on_outcome runs on one of the streamer's threads: close() there would wait for
    itself. It is refused (logged, as whatever on_outcome raises); close() from the caller
    then ends everything and lets go of the caches' memory."""
    refused = []

    def on_outcome(outcome):
        try:
            streamer.close()
        except pdhal.InvalidArgumentError as e:
            refused.append(str(e))

    buffers = [[ops.host_alloc(8 * 64) for _ in range(2)] for _ in range(LAYERS)]
    for row in buffers:
        for buffer in row:
            buffer.as_numpy("uint8", (8 * 64,))[:] = 1
    layout = transfer.CacheLayout.from_caches(
        [[b.as_numpy("uint8", (8, 64)) for b in row] for row in buffers]
    )
    streamer = transfer.KVStreamer(layout, BLOCK_TOKENS, on_outcome=on_outcome)
    streamer.add_request("r", [0], 4)
    streamer.set_destination("r", streamer.connect(decode.described), [0], decode.expect("r"))
    stream_whole(streamer, "r", 4)
    deadline = time.monotonic() + 30
    while not refused:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert "would wait for itself" in refused[0]
    streamer.close()
    for row in buffers:
        for buffer in row:
            ops.host_free(buffer)  # not pinned any more


def test_device_memory_is_refused_by_a_host_only_transport():
    """shm copies with memmove: a layout over device memory (here a stand-in naming its
    device by __cuda_array_interface__) is refused when the streamer is made, not copied
    from (a crash)."""

    class DeviceArray:
        def __init__(self, nbytes: int):
            self._host = np.zeros(nbytes, np.uint8)  # an address that is not the device's
            self.__cuda_array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (self._host.ctypes.data, False),
                "version": 3,
            }

    regions = [DeviceArray(8 * 64) for _ in range(LAYERS)]
    layout = transfer.CacheLayout(
        regions, [[transfer.CacheSpec(n, 0, 64, 64, 8)] for n in range(LAYERS)]
    )
    with pytest.raises(pdhal.InvalidArgumentError, match="region 0 is gpu.* memory; .* moves cpu"):
        transfer.KVStreamer(layout, BLOCK_TOKENS)


SHRINKING_DECODE = """
import json, os, sys
from pdhal import ops, transfer
buffers = [[ops.host_alloc(8 * 64) for _ in range(2)] for _ in range(3)]
caches = [[b.as_numpy("uint8", (8, 64)) for b in row] for row in buffers]
receiver = transfer.KVReceiver(transfer.CacheLayout.from_caches(caches), "shrinking", slots=8)
print(json.dumps([receiver.describe(), receiver.expect("r", 30)]), flush=True)
sys.stdin.readline()
for row in buffers:
    for buffer in row:
        os.truncate(buffer.path, 0)  # what it served is gone behind the prefill's mapping
print("shrunk", flush=True)
sys.stdin.readline()
"""


def test_a_decode_side_that_shrinks_its_shared_files_fails_the_request_not_the_process(
    namespace,
):
    """A hostile decode process truncates the files behind its caches once the prefill side
    mapped them: the prefill's next copy meets pages past their end (SIGBUS, which would
    kill the prefill process); the request fails naming it, and the process goes on."""
    peer = python_child(SHRINKING_DECODE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    streamer = make_streamer()
    try:
        described, ticket = json.loads(peer.stdout.readline())
        dest = streamer.connect(described)
        streamer.add_request("r", [1], 4)
        streamer.set_destination("r", dest, [1], ticket)
        peer.stdin.write("shrink\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "shrunk"
        stream_whole(streamer, "r", 4)
        [ended] = outcomes_until(streamer, 1)
        assert not ended.landed and "SIGBUS" in ended.reason
    finally:
        streamer.close()
        peer.kill()
        peer.wait(timeout=30)
        peer.stdin.close()
        peer.stdout.close()
        pdhal.cleanup(namespace)  # what the killed peer left


def test_every_region_s_claimed_kind_is_compared_with_what_the_link_maps():
    """A description's claim of each region's kind of memory is compared with what a link
    that can tell mapped there: a false claim of any one region, the first, a middle one or
    the last, is refused naming that region and both kinds; true claims pass, and nothing
    is compared where the link cannot tell or the description does not claim."""
    from pdhal._transfer.contract import Link, require_claimed_kinds

    link = Link()
    link.region_kinds = ["gpu", "gpu", "cpu"]
    for region, mapped in enumerate(link.region_kinds):
        claims = list(link.region_kinds)
        claims[region] = "xpu"
        with pytest.raises(
            pdhal.InvalidArgumentError,
            match=f"region {region} is said to be xpu memory, but what the link maps there is "
            f"{mapped} memory",
        ):
            require_claimed_kinds(link, claims)
    require_claimed_kinds(link, ["gpu", "gpu", "cpu"])
    require_claimed_kinds(link, None)
    require_claimed_kinds(Link(), ["xpu"])  # (region_kinds None: it cannot tell)
