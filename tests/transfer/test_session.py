"""The control plane as library API (pdhal.transfer.PrefillService, DecodeClient), between
real processes (pdhal.testing.session_peers): a claim lands byte for byte, head by head
across tensor-parallel splits; a hello that cannot pair is refused naming both sides; a
silent or killed peer is an error within the keepalive bound; a cancel frees the blocks at
once and fails the request to its prefill side; a hostile peer's message fails that
session only."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest

import pdhal
from pdhal import InvalidArgumentError, SessionError, ops, transfer
from pdhal._transfer import control, messages
from pdhal.testing import ManualClock
from pdhal.testing.session_peers import (
    CACHES,
    KEY,
    KV_HEADS,
    LAYERS,
    Peer,
    _caches,
    value,
)


@pytest.fixture
def peers():
    """Peers started by a test, closed (or reaped) after it."""
    started: list[Peer] = []

    def start(role: str, *options: str, env: dict | None = None) -> Peer:
        peer = Peer(role, *options, env=env)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.close()


def prefill(start, *options: str) -> tuple[Peer, str]:
    peer = start("prefill", *options)
    [address] = peer.read("listening")
    return peer, address


def connect(client: Peer, address: str) -> None:
    """`client`'s session with `address` made now, so that its next claim there goes at
    once (claim() makes it in the background otherwise)."""
    client.send("connect", address)
    assert client.read("connected") == [address]


def assert_landed(blocks: list, src_blocks: list[int], got: list) -> None:
    """Every head of every claimed block holds, in every byte, what the prefill wrote in
    the matching source block."""
    for dst, src, layers in zip(blocks, src_blocks, got):
        for layer in range(LAYERS):
            for cache in range(CACHES):
                for head, first, uniform in layers[layer][cache]:
                    assert (first, uniform) == (value(layer, cache, src, head), True), (
                        dst,
                        src,
                        layer,
                        cache,
                        head,
                    )


def assert_both_sides_landed(service, client, request, blocks, src_blocks) -> None:
    """`request` landed on the prefill side and then on the decode side, into `blocks`,
    byte for byte from `src_blocks`."""
    assert service.read("outcome") == [request, True, ""]
    client.send("wait", request, blocks, 30)
    landed, reason, free, got = client.read("outcome")
    assert (landed, reason, free) == (True, "", True)
    assert_landed(blocks, src_blocks, got)


def test_a_claim_from_another_process_lands_byte_for_byte(peers):
    service, address = prefill(peers)
    client = peers("decode")
    client.send("claim", "r1", address, [5, 2, 7], 10, 30)
    assert client.read("claimed") == ["r1"]
    service.send("add", "r1", [1, 3, 6], 10)
    assert service.read("added") == ["r1"]
    assert_both_sides_landed(service, client, "r1", [5, 2, 7], [1, 3, 6])


def test_a_followed_step_claimed_midway_sends_each_layer_at_its_signal(peers, namespace):
    """PrefillService.follow: one call for the step, none per layer. The decode side claims
    after layer 0 was computed and signalled, and after the messager closed its reader (as
    one whose loop ended before the decode side's blocks came free): that layer goes at
    once, the others each at its signal (the prefill caches are zeros until a layer is
    computed, so a copy that did not wait lands zeros), byte for byte across the two
    processes."""
    service, address = prefill(peers, "--blank")
    client = peers("decode")
    connect(client, address)
    service.send("add", "r1", [1, 3, 6], 10, False)
    service.read("added")
    service.send("follow", "r1", 10)
    service.read("followed")
    service.send("signal", 0)
    service.read("signalled")
    service.send("unread")
    service.read("unread")
    client.send("claim", "r1", address, [5, 2, 7], 10, 30)
    client.read("claimed")
    service.send("claimed", "r1", 30)
    service.read("claimed")
    for layer in range(1, LAYERS):
        service.send("signal", layer)
        service.read("signalled")
    assert_both_sides_landed(service, client, "r1", [5, 2, 7], [1, 3, 6])


def test_a_claim_of_a_step_followed_before_a_later_one_waits_for_the_later_signals(peers):
    """r2's step is followed ahead (before it begins) while r1's computes; r1 is claimed
    then: its layer signalled by then goes at once, the others wait for the later step's
    signals (the streamer takes a channel's steps in order; those imply its own), and
    land byte for byte."""
    service, address = prefill(peers, "--blank")
    client = peers("decode")
    connect(client, address)
    for request, blocks in (("r1", [1, 3, 6]), ("r2", [0, 2, 4])):
        service.send("add", request, blocks, 10, False)
        service.read("added")
    service.send("follow", "r1", 10)
    [step] = service.read("followed")
    service.send("signal", 0)
    service.read("signalled")
    service.send("follow", "r2", 10, True)
    assert service.read("followed") == [step + 1]
    client.send("claim", "r1", address, [5, 2, 7], 10, 30)
    client.read("claimed")
    service.send("claimed", "r1", 30)
    service.read("claimed")
    for signalled in range(1, LAYERS):
        service.send("signal", signalled)
        service.read("signalled")
    service.send("step")
    service.read("stepped")
    for signalled in range(LAYERS):
        service.send("signal", signalled)
        service.read("signalled")
    assert_both_sides_landed(service, client, "r1", [5, 2, 7], [1, 3, 6])


def test_a_waiting_poll_is_woken_by_the_landing_and_reports_it(peers):
    """A decode side waiting for something to report (poll(timeout)) hears from the
    prefill side that the part ended, and finds it landed then: not at its timeout, and
    not before the slot says so (a wake with nothing to report would return nothing)."""
    service, address = prefill(peers)
    client = peers("decode")
    connect(client, address)
    client.send("claim", "r1", address, [5, 2, 7], 10, 60)
    client.read("claimed")
    client.send("poll", 10)
    client.read("polling")
    service.send("add", "r1", [1, 3, 6], 10)
    reported, seconds = client.read("polled", bound=60)
    assert reported == ["r1"] and seconds < 5, (reported, seconds)


def test_a_waiting_poll_is_woken_by_an_unserved_claim(peers):
    """A claim waiting for its request is answered `unserved` once the prefill side fails
    that request: that wakes a waiting poll too, which reports the failure."""
    service, address = prefill(peers)
    client = peers("decode")
    connect(client, address)
    client.send("claim", "gone", address, [1], 4, 60)
    client.read("claimed")
    client.send("poll", 10)
    client.read("polling")
    service.send("fail", "gone", "the prefill worker restarted")
    service.read("failed")
    reported, seconds = client.read("polled", bound=60)
    assert reported == ["gone"] and seconds < 5, (reported, seconds)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_each_decode_rank_gets_its_heads_from_the_prefill_ranks_that_hold_them(
    peers, prefill_tp, decode_tp
):
    """Prefill ranks listen on ports in a row; each decode rank claims from rank 0's address
    and gets every head it holds, each from the rank holding it; each request ends once on
    every prefill rank that sent a part of it."""
    services, address = [], None
    for rank in range(prefill_tp):
        listen = "127.0.0.1:0" if rank == 0 else transfer.rank_address(address, rank)
        peer, at = prefill(
            peers, "--tp-rank", str(rank), "--tp-size", str(prefill_tp), "--listen", listen
        )
        address = address or at
        services.append(peer)
    clients = [
        peers("decode", "--tp-rank", str(rank), "--tp-size", str(decode_tp))
        for rank in range(decode_tp)
    ]
    for client in clients:
        client.send("claim", "r1", address, [4, 0], 8, 30)
        assert client.read("claimed") == ["r1"]
    for service in services:
        service.send("add", "r1", [2, 5], 8)
        assert service.read("added") == ["r1"]
    for service in services:
        assert service.read("outcome") == ["r1", True, ""]
    seen = set()
    for rank, client in enumerate(clients):
        client.send("wait", "r1", [4, 0], 30)
        landed, reason, free, got = client.read("outcome")
        assert (landed, reason, free) == (True, "", True)
        assert_landed([4, 0], [2, 5], got)
        heads = {h for layer in got[0] for cache in layer for h, _, _ in cache}
        assert heads == set(transfer.rank_heads(KV_HEADS, decode_tp, rank))
        seen |= heads
    assert seen == set(range(KV_HEADS))


def test_a_hello_of_another_layout_or_namespace_is_refused_naming_both_sides(peers):
    service, address = prefill(peers, "--dtype", "bfloat16")
    other_heads = peers("decode", "--head-bytes", "8")
    other_heads.send("connect", address)
    kind, text = other_heads.read("error")
    assert kind == "RefusedError"
    assert "the prefill side (rank 0 of 1, pid" in text and "the decode side (rank 0" in text
    assert "bytes" in text  # what differs: a head's bytes
    other_heads.send("claim", "r1", address, [1], 4, 30)  # a claim there fails, saying why
    other_heads.send("wait", "r1", [1], 30)
    landed, reason, free, _ = other_heads.read("outcome")
    assert (landed, free) == (False, True) and "refused" in reason and "bytes" in reason
    other_type = peers("decode", "--dtype", "float16")  # the same bytes per element
    other_type.send("connect", address)
    kind, text = other_type.read("error")
    assert kind == "RefusedError" and "the decode side (rank 0" in text
    assert "elements of 'bfloat16' here, 'float16' on the peer" in text
    env = dict(os.environ, PDHAL_NAMESPACE="elsewhere")
    elsewhere = peers("decode", env=env)
    elsewhere.send("connect", address)
    kind, text = elsewhere.read("error")
    assert kind == "RefusedError"
    assert "namespace: 'default' here, 'elsewhere' there" in text.replace(
        os.environ.get("PDHAL_NAMESPACE", "default"), "default"
    )


def test_a_hello_of_another_protocol_version_is_refused_naming_both(peers):
    """A peer of protocol 1 (before `ended`; a raw hello from this process) is refused at
    the hello, with both versions named, before anything else of it is read."""
    _, address = prefill(peers)
    conn = control.dial(address, KEY, 10)
    conn.write(b'{"type": "hello", "protocol": 1, "facts": {}, "described": {}}', 10)
    answer = control.read_message(conn, 10)
    conn.close()
    assert isinstance(answer, messages.Refused)
    assert "protocol version 1; this side speaks version 2" in answer.reason


def test_a_peer_without_the_key_is_dropped_at_the_handshake(peers):
    _, address = prefill(peers)
    with pytest.raises(SessionError, match="does not hold this deployment's key"):
        control.dial(address, b"another key", 10)


def test_a_silent_service_fails_the_claims_on_it_within_the_keepalive_bound(peers):
    """The prefill service is stopped (SIGSTOP: its kernel still acknowledges): the client
    hears nothing for its keepalive (1 s) and fails the request then, not at its 60 s
    load timeout; its blocks stay held (a stopped service may write again)."""
    service, address = prefill(peers, "--keepalive", "1")
    client = peers("decode", "--keepalive", "1")
    connect(client, address)
    client.send("claim", "r1", address, [1, 2], 8, 60)
    assert client.read("claimed") == ["r1"]
    service.stop()
    started = time.monotonic()
    client.send("wait", "r1", [1, 2], 30)
    landed, reason, free, _ = client.read("outcome")
    assert time.monotonic() - started < 8  # its 1 s bound, not the 60 s load timeout
    assert (landed, free) == (False, False)
    assert "said nothing for 1 s" in reason
    service.resume()


def test_sides_of_different_keepalive_bounds_keep_each_other_alive(peers):
    """A service bounded at 1 s and a decode side at 30 s: the decode side pings within
    a third of the smaller bound (said in the hello), so the session outlives several of
    the service's bounds with nothing else said, and the claim made before lands."""
    service, address = prefill(peers, "--keepalive", "1")
    client = peers("decode", "--keepalive", "30")
    client.send("claim", "r1", address, [1, 2], 8, 60)
    assert client.read("claimed") == ["r1"]
    time.sleep(3.0)  # three of the service's bounds, nothing to say but pings
    service.send("add", "r1", [3, 4], 8)
    assert service.read("added") == ["r1"]
    assert service.read("outcome") == ["r1", True, ""]
    client.send("wait", "r1", [1, 2], 30)
    assert client.read("outcome")[:3] == [True, "", True]


def test_a_restarted_service_is_served_again_and_frees_what_the_dead_one_held(peers):
    service, address = prefill(peers, "--keepalive", "1")
    client = peers("decode", "--keepalive", "1")
    connect(client, address)
    client.send("claim", "r1", address, [1, 2], 8, 60)
    assert client.read("claimed") == ["r1"]
    service.kill()
    removed, _ = pdhal.cleanup(pdhal.namespace())  # what the killed service left (its caches)
    assert removed
    client.send("wait", "r1", [1, 2], 30)
    landed, reason, free, _ = client.read("outcome")
    assert (landed, free) == (False, False)
    again, _ = prefill(peers, "--listen", address)
    client.send("claim", "r2", address, [3], 4, 30)
    assert client.read("claimed") == ["r2"]
    client.send("freed", 10)  # the dead service's part: nothing can write it now
    assert client.read("freed") == [["r1"]]
    again.send("add", "r2", [7], 4)
    again.read("added")
    client.send("wait", "r2", [3], 30)
    landed, reason, free, got = client.read("outcome")
    assert (landed, free) == (True, True)
    assert_landed([3], [7], got)


@pytest.mark.parametrize("session", ["made first", "made by the claim"])
def test_a_cancel_frees_the_blocks_at_once_and_fails_the_request_to_its_prefill_side(
    peers, session
):
    """Cancelled before its prefill side had it: answered at once (blocks free), and the
    request the prefill side adds afterwards fails at once (not at its 60 s claim lease);
    also when the cancel came before the claim went (its session being made): the cancel
    follows the claim."""
    service, address = prefill(peers)
    client = peers("decode")
    if session == "made first":
        connect(client, address)
    client.send("claim", "r1", address, [1, 2], 8, 60)
    assert client.read("claimed") == ["r1"]
    client.send("cancel", "r1")
    client.read("cancelled")
    client.send("wait", "r1", [1, 2], 30)
    landed, reason, free, _ = client.read("outcome")
    assert (landed, free) == (False, True)
    assert "cancelled" in reason
    service.send("add", "r1", [1, 2], 8)
    service.read("added")
    landed, why = service.read("outcome", bound=30)[1:]
    assert not landed and "cancelled" in why


def test_a_prompt_the_decode_side_has_cached_lands_at_once_with_nothing_sent(peers):
    """A claim with every block cached (a prefix cache hit): reported landed on both sides
    at once, before its prefill side computed a layer, whether the claim comes before the
    request or after it (not at the 60 s claim lease)."""
    service, address = prefill(peers)
    client = peers("decode")
    service.send("add", "after", [1, 2], 8, False)
    service.read("added")
    for request in ("after", "before"):
        client.send("claim", request, address, [], 8, 60, 2)
        assert client.read("claimed") == [request]
        client.send("wait", request, [], 30)
        assert client.read("outcome") == [True, "", True, []]
    service.send("add", "before", [3, 4], 8, False)
    service.read("added")
    ended = sorted([service.read("outcome", bound=30), service.read("outcome", bound=30)])
    assert ended == [["after", True, ""], ["before", True, ""]]


def test_a_claim_of_a_request_failed_or_ended_is_answered_at_once(peers):
    """A request the engine failed before adding it, and one that ended: a claim of either
    fails at once with the reason (its blocks free), not at its 60 s timeout."""
    service, address = prefill(peers)
    client = peers("decode")
    service.send("fail", "gone", "the prefill worker restarted")
    service.read("failed")
    service.send("add", "done", [5], 4)
    service.read("added")
    client.send("claim", "done", address, [3], 4, 60)
    client.read("claimed")
    assert service.read("outcome", bound=30) == ["done", True, ""]
    client.send("wait", "done", [3], 30)
    assert client.read("outcome")[:3] == [True, "", True]
    for request, why in (("gone", "restarted"), ("done", "ended (landed) before this claim")):
        client.send("claim", request, address, [1], 4, 60)
        client.read("claimed")
        client.send("wait", request, [1], 30)
        landed, reason, free, _ = client.read("outcome")
        assert (landed, free) == (False, True) and why in reason, reason


def test_a_request_nobody_claims_fails_at_its_claim_lease_not_before(caches):
    """On the service's clock: a request added and never claimed fails claim_timeout
    later, not a moment before, naming its lease."""
    clock = ManualClock()
    service = transfer.PrefillService(
        caches, 4, key=KEY, kv_heads=KV_HEADS, claim_timeout=60, clock=clock
    )
    try:
        service.add_request("r1", [1], 4)
        clock.advance(59.99)
        assert service.poll(timeout=0.5) == []  # (its lease job has not run)
        clock.advance(0.01)
        assert service.poll() == [
            transfer.Outcome("r1", False, "no decode side claimed it within 60 s")
        ]
    finally:
        service.close()


def test_a_follow_the_streamer_cannot_take_is_refused_at_the_call(caches):
    """What KVStreamer.follow refuses, PrefillService.follow refuses at the call, naming
    what was wrong."""
    service = transfer.PrefillService(caches, 4, key=KEY, kv_heads=KV_HEADS)
    try:
        service.add_request("r1", [1], 4)
        for signals, ready, why in (
            ("reader", [("r1", 4)], "ProgressReader"),
            (None, "r1", "ready must be a list"),
            (None, [("r1", 0)], "tokens"),
        ):
            with pytest.raises(InvalidArgumentError, match=why):
                service.follow(signals, 1, ready)
    finally:
        service.close()


def test_a_malformed_claim_ends_that_session_only(peers, receiver):
    """A hostile decode side sends a claim whose blocks are not ids: its session ends, told
    why; another decode side's claims land all the same."""
    service, address = prefill(peers)
    conn = hand_made_session(address, receiver)
    conn.write(
        b'{"type": "claim", "request": "r9", "part": "r9@0>0", "blocks": ["x"], '
        b'"tokens": 4, "cached_blocks": 0, "ticket": {}}',
        10,
    )
    answer = next_message(conn)
    conn.close()
    assert isinstance(answer, messages.Refused)
    assert "blocks[0] must be a block id" in answer.reason
    honest = peers("decode")
    honest.send("claim", "r1", address, [0], 4, 30)
    honest.read("claimed")
    service.send("add", "r1", [3], 4)
    service.read("added")
    honest.send("wait", "r1", [0], 30)
    assert honest.read("outcome")[:3] == [True, "", True]


def hand_made_session(address: str, receiver) -> control.Frames:
    """A decode side's session made by hand (a hostile peer's): dialled, its hello (with
    `receiver`'s description) welcomed."""
    conn = control.dial(address, KEY, 10)
    facts = messages.Facts(
        "decode",
        "hand-made",
        os.getpid(),
        "here",
        "shm",
        transfer.transport("shm").version,
        os.environ["PDHAL_NAMESPACE"],
        4,
        KV_HEADS,
        0,
        1,
        5.0,
    )
    control.write_message(conn, messages.Hello(messages.PROTOCOL, facts, receiver.describe()), 10)
    assert isinstance(control.read_message(conn, 10), messages.Welcome)
    return conn


def next_message(conn: control.Frames) -> messages.Message:
    """The next message on `conn` that is not a ping."""
    answer = control.read_message(conn, 10)
    while isinstance(answer, messages.Ping):
        answer = control.read_message(conn, 10)
    return answer


@pytest.fixture
def caches():
    """The caches of rank 0 of 1 (host memory, zeros) in this process, as a CacheLayout."""
    layout, _, _ = _caches(0, 1, 16, fill=False)
    yield layout
    for buffer in layout.memory:
        ops.host_free(buffer)


@pytest.fixture
def receiver(caches):
    """A KVReceiver in this process (a hand-made peer's, or a client's)."""
    r = transfer.KVReceiver(caches, f"here-{os.getpid()}")
    yield r
    r.close()


def test_a_claim_for_blocks_outside_the_caches_is_refused_at_the_call(receiver):
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4)
    with pytest.raises(InvalidArgumentError, match="outside the decode caches' 8 blocks"):
        client.claim("r1", "127.0.0.1:1", [99], tokens=4, timeout=5)
    with pytest.raises(InvalidArgumentError, match="4 tokens from block 0 on are 1 blocks"):
        client.claim("r1", "127.0.0.1:1", [1, 2], tokens=4, timeout=5)
    with pytest.raises(InvalidArgumentError, match="prefill must be 'HOST:PORT'"):
        client.claim("r1", "nowhere", [1], tokens=4, timeout=5)
    assert client.poll() == []  # nothing was claimed
    with pytest.raises(SessionError, match="cannot reach the session service at 127.0.0.1:1"):
        client.connect("127.0.0.1:1")
    client.close()


def test_a_claim_ends_by_its_own_timeout_and_nothing_is_reported_after_close(receiver):
    """While its session is being made (a service that never answers, connect_timeout
    60 s), a claim still fails by its own timeout (30 s on the client's clock, not a
    moment before); a host name the resolver refuses fails its claim too (connect()
    raises); claims in flight at close() are not reported after it."""
    hung = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{hung.getsockname()[1]}"
    clock = ManualClock()
    client = transfer.DecodeClient(
        receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4, connect_timeout=60, clock=clock
    )
    client.claim("short", address, [1], tokens=4, timeout=30)
    bad_host = "a" * 70 + ".example:5000"  # a label idna refuses (a UnicodeError)
    client.claim("bad host", bad_host, [2], tokens=4, timeout=30)
    clock.advance(29.99)
    ended = {}
    while "bad host" not in ended:
        ended.update((o.request_id, o) for o in client.poll())
        time.sleep(0.01)
    assert "short" not in ended  # (its timeout job has not run; the dial hangs)
    clock.advance(0.01)
    ended.update((o.request_id, o) for o in client.poll())
    assert "its timeout passed" in ended["short"].reason and ended["short"].blocks_free
    assert "cannot reach the session service" in ended["bad host"].reason
    with pytest.raises(SessionError, match="cannot reach the session service"):
        client.connect(bad_host)
    client.claim("in flight", address, [3], tokens=4, timeout=30)
    client.close()
    time.sleep(0.2)
    assert client.poll() == []
    hung.close()


def test_a_keepalive_below_the_floor_is_refused_from_a_caller_and_from_a_peer(receiver):
    """A side pings every third of the smaller keepalive: a peer saying 1e-9 s would have
    it flood pings, so a hello saying less than 0.1 s is malformed, as is such a caller."""
    with pytest.raises(InvalidArgumentError, match="at least 0.1 s"):
        transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4, keepalive=0.01)
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4)
    facts = dataclasses.replace(client.facts, keepalive=1e-9)
    frame = messages.encode(messages.Hello(messages.PROTOCOL, facts, {}))
    with pytest.raises(SessionError, match="keepalive must be at least 0.1 s"):
        messages.decode(frame)
    client.close()


def test_head_shards_of_many_ranks_are_found_in_linear_time():
    """A peer may say up to 65,536 ranks: each head's first holder is found once, not by
    looking back over every earlier rank for every pair (minutes at this size)."""
    shards = transfer.head_shards(4, 1 << 16, 1)
    assert sorted(shards) == [(h * (1 << 14), 0) for h in range(4)]


def test_a_claim_never_waits_on_the_network_and_fails_when_its_session_cannot_be_made(receiver):
    """claim() returns at once whatever the service does: one that accepts and never
    answers the hello (a hung process) holds no caller; the claim fails once its session
    cannot be made (connect_timeout, 2 s), reported by poll with its blocks free, as does one
    to an address that refuses connections."""
    hung = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    address = f"127.0.0.1:{hung.getsockname()[1]}"
    client = transfer.DecodeClient(
        receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4, connect_timeout=2
    )
    started = time.monotonic()
    for i in range(5):  # each would wait a whole connect_timeout if claim() dialled itself
        client.claim(f"r{i}", address, [i], tokens=4, timeout=30)
    client.claim("refused", "127.0.0.1:1", [7], tokens=4, timeout=30)
    assert time.monotonic() - started < 2  # the first claim alone would take 2 s
    assert {f"r{i}" for i in range(5)} <= set(client.unsent())  # sessions being made
    ended = {}
    while len(ended) < 6:
        ended.update((o.request_id, o) for o in client.poll())
        assert time.monotonic() - started < 30, ended
        time.sleep(0.01)
    for i in range(5):
        assert (ended[f"r{i}"].landed, ended[f"r{i}"].blocks_free) == (False, True)
        assert f"with {address} failed" in ended[f"r{i}"].reason
    assert "cannot reach the session service at 127.0.0.1:1" in ended["refused"].reason
    client.close()
    hung.close()


def test_a_silent_decode_side_fails_its_requests_on_the_prefill_side(peers):
    """The decode process is stopped after its claim, before any layer was computed: the
    prefill side fails the request within its keepalive (1 s), not at the claim's 60 s
    deadline (and sends nothing of it)."""
    service, address = prefill(peers, "--keepalive", "1")
    service.send("add", "r0", [5], 4)
    service.read("added")
    client = peers("decode", "--keepalive", "1")
    service.send("add", "r1", [3, 4], 8, False)
    service.read("added")
    client.send("claim", "r1", address, [1, 2], 8, 60)
    client.send("claim", "r0", address, [3], 4, 60)  # once it landed, r1's claim was heard
    assert service.read("outcome", bound=30) == ["r0", True, ""]
    client.stop()
    request, landed, why = service.read("outcome", bound=30)
    assert (request, landed) == ("r1", False)
    assert "its decode side's session ended: the peer said nothing for 1 s" in why, why
    client.resume()


def test_a_claim_naming_another_rank_s_part_is_unserved(peers, receiver):
    """A decode side (hand-made here) claims a part named for another decode rank: the
    service answers unserved, naming the part it should have named, and serves on."""
    _, address = prefill(peers)
    conn = hand_made_session(address, receiver)
    ticket = receiver.expect("r1@0>1", 30)
    control.write_message(conn, messages.Claim("r1", "r1@0>1", [2], 4, 0, ticket), 10)
    answer = next_message(conn)
    conn.close()
    assert answer == messages.Unserved(
        "r1@0>1",
        "a claim from decode rank 0 to prefill rank 0 names part 'r1@0>0', not 'r1@0>1'",
    )


def test_a_request_whose_decode_side_died_before_it_was_added_fails_once_added(peers):
    """The decode process claims r1, then r0 (which the prefill side has: once r0 landed,
    the claim of r1 before it on the same session was heard), then is killed before the
    prefill side has r1: r1 fails as soon as it is added, not at the 60 s claim lease."""
    service, address = prefill(peers)
    service.send("add", "r0", [5], 4)
    service.read("added")
    client = peers("decode")
    client.send("claim", "r1", address, [1, 2], 8, 60)
    client.send("claim", "r0", address, [3], 4, 60)
    assert client.read("claimed") == ["r1"] and client.read("claimed") == ["r0"]
    assert service.read("outcome", bound=30) == ["r0", True, ""]
    client.kill()
    pid, why = service.read("session_end", bound=30)  # (the engine hears it: on_session_end)
    assert pid == client.proc.pid and why, why
    pdhal.cleanup(pdhal.namespace())  # what the killed decode side left (its caches)
    service.send("add", "r1", [3, 4], 8)
    service.read("added")
    request, landed, why = service.read("outcome", bound=30)
    assert (request, landed) == ("r1", False)
    # the session's end (or, added before the service heard it, the dead destination)
    assert "no decode side claimed it" not in why, why


def test_a_peer_without_the_key_cannot_reflect_the_service_s_own_proof(peers):
    """The reflection attack: take the service's challenge on one connection and offer it as
    one's own on a second, hoping the service proves it there first. The service proves
    nothing before its peer did, and a proof covers the prover's role and both
    challenges: both connections are dropped, neither is welcomed."""
    import socket

    _, address = prefill(peers)
    host, port = control.parse_address(address)
    first = control.Frames(socket.create_connection((host, port)), "first")
    second = control.Frames(socket.create_connection((host, port)), "second")
    theirs = first.read(10, 10)  # the service's challenge on the first connection
    second.read(10, 10)
    second.write(theirs, 10)  # offered back to it as this side's own challenge
    assert second.read(2, 2) is None  # it proves nothing before its peer did
    first.write(os.urandom(32), 10)  # this side's challenge...
    first.write(os.urandom(32), 10)  # ...and a guess at a proof
    with pytest.raises(SessionError):  # dropped, never welcomed
        first.read(10, 10)
    first.close()
    second.close()


def test_a_local_link_is_authenticated_within_its_bound_and_waits_unbounded_once_up():
    """transfer.authenticate over a local socket (an engine's worker and its messager): both
    sides hold the key and a frame passes, read with no bound on its first byte; a side
    without the key is refused at both ends; a silent peer is dropped at the bound."""
    import threading

    def both(key_a: bytes, key_b: bytes) -> list:
        a, b = socket.socketpair(socket.AF_UNIX)
        got = [None, None]

        def side(i, sock, key):
            try:
                got[i] = transfer.authenticate(sock, key, 10, f"side{i}", dialled=i == 0)
            except SessionError as e:
                got[i] = e

        threads = [threading.Thread(target=side, args=(0, a, key_a))]
        threads[0].start()
        side(1, b, key_b)
        threads[0].join()
        return got

    dialler, acceptor = both(KEY, KEY)
    timer = threading.Timer(0.2, dialler.write, (b"late", 10))
    timer.start()
    assert acceptor.read(None, 10) == b"late"  # (no bound on the first byte: it waited)
    timer.join()
    dialler.close()
    acceptor.close()
    refused = both(KEY, b"another key")
    assert all(isinstance(end, SessionError) for end in refused), refused
    a, b = socket.socketpair(socket.AF_UNIX)
    with pytest.raises(SessionError, match="no challenge came within 0.2 s"):
        transfer.authenticate(a, KEY, 0.2, "a silent peer", dialled=False)
    b.close()


def test_a_link_on_a_descriptor_past_1024_works():
    """An engine's process holds thousands of descriptors (vLLM raises its limit to 65535):
    a link whose socket is numbered past select()'s 1024 is read and written like any."""
    import resource
    import threading

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    try:
        a, b = socket.socketpair(socket.AF_UNIX)
        high = []
        for sock, fd in ((a, 2000), (b, 2001)):
            os.dup2(sock.fileno(), fd)
            high.append(socket.socket(fileno=fd))
            sock.close()
        got = []
        dialler = threading.Thread(
            target=lambda: got.append(transfer.authenticate(high[0], KEY, 10, "a", dialled=True))
        )
        dialler.start()
        acceptor = transfer.authenticate(high[1], KEY, 10, "b", dialled=False)
        dialler.join()
        got[0].write(b"past 1024", 10)
        assert acceptor.read(10, 10) == b"past 1024"
        got[0].close()
        acceptor.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_closed_service_frees_its_address_for_a_successor(receiver):
    """close() releases the port at once (its accept thread woken, not left holding the
    listening socket): a successor in this process listens at the same address, and a
    decode side's next claim is served by it."""
    layout = receiver.layout  # (the caches' contents do not matter here)
    first = transfer.PrefillService(layout, 4, key=KEY, kv_heads=KV_HEADS)
    address = first.address
    first.close()
    successor = transfer.PrefillService(
        layout, 4, key=KEY, kv_heads=KV_HEADS, listen=f"127.0.0.1:{address.split(':')[1]}"
    )
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4)
    try:
        successor.add_request("r1", [1], 4)
        for layer in range(LAYERS):
            successor.layer_ready(layer, [("r1", 4)])
        client.claim("r1", successor.address, [2], tokens=4, timeout=30)
        assert successor.poll(timeout=30) == [transfer.Outcome("r1", True)]
    finally:
        client.close()
        successor.close()


def test_a_closing_service_tells_its_decode_sides_before_their_sessions_end(peers):
    """close() with a part being sent and a claim still waiting for its request: the part
    gets its failure word and the claim is unserved before the session ends, so the decode
    side's blocks are free at once (not held, as after a session that merely dropped)."""
    service, address = prefill(peers)
    client = peers("decode")
    service.send("add", "sending", [1], 4, False)  # no layer ready: it stays in flight
    service.send("add", "probe", [5], 4)
    assert service.read("added") == ["sending"] and service.read("added") == ["probe"]
    for request, block in (("sending", 2), ("waiting", 3), ("probe", 4)):
        client.send("claim", request, address, [block], 4, 60)
        assert client.read("claimed") == [request]
    # the claims went in order on one session: once the probe landed, the others were heard
    assert service.read("outcome", bound=30) == ["probe", True, ""]
    service.send("exit")
    for request, block in (("sending", 2), ("waiting", 3)):
        client.send("wait", request, [block], 30)
        landed, reason, free, _ = client.read("outcome")
        said = "the prefill service was closed" in reason  # (not merely a session lost)
        assert (landed, free, said) == (False, True, True), (request, reason)


def test_a_rank_whose_heads_an_earlier_rank_holds_ends_its_requests_at_once(peers):
    """Prefill TP 8 over 4 KV heads: rank 1 holds head 0, as rank 0 does, so no decode side
    ever claims from it: its requests land at once (its blocks free), not fail at the
    claim lease. Rank 0 holds its head first: its requests wait for their claim."""
    replica, _ = prefill(peers, "--tp-rank", "1", "--tp-size", "8", "--claim-timeout", "60")
    replica.send("add", "r1", [1], 4)
    replica.read("added")
    assert replica.read("outcome", bound=30) == ["r1", True, ""]
    first, _ = prefill(peers, "--tp-rank", "0", "--tp-size", "8", "--claim-timeout", "0.5")
    first.send("add", "r1", [1], 4)
    first.read("added")
    assert first.read("outcome", bound=30)[:2] == ["r1", False]  # by its claim lease


def test_a_dead_service_s_held_blocks_are_freed_and_a_stopped_one_s_are_not(peers):
    """A session lost with a part in flight holds its blocks (its prefill side may still
    write). Killed: its address refuses connections, so nothing can write them: freed at
    once, with no successor needed. Stopped (alive, silent past the keepalive): its address
    does not refuse, so they stay held."""
    stopped, at_stopped = prefill(peers, "--keepalive", "1")
    killed, at_killed = prefill(peers, "--keepalive", "1")
    client = peers("decode", "--keepalive", "1")
    for request, address, block in (("s1", at_stopped, 1), ("k1", at_killed, 2)):
        connect(client, address)
        client.send("claim", request, address, [block], 4, 60)
        assert client.read("claimed") == [request]
    stopped.stop()
    killed.kill()
    pdhal.cleanup(pdhal.namespace())  # what the killed service left (its caches)
    for request, block in (("s1", 1), ("k1", 2)):
        client.send("wait", request, [block], 30)
        landed, _, free, _ = client.read("outcome")
        assert (landed, free) == (False, False), request
    client.send("freed", 10)
    assert client.read("freed") == [["k1"]]
    client.send("freed", 1)  # (its address was probed as its session was lost)
    assert client.read("freed") == [[]]
    stopped.resume()


def test_a_routers_abandon_frees_what_no_decode_side_claimed_on_every_rank(peers):
    """What a router says when the decode request it paired with a prefill failed, told at
    rank 0's address: on both ranks a request nobody claimed fails now (not at its 600 s
    claim lease), and one added after the word fails as it is added; a request a decode
    side claimed first is left to it and lands, whether it was added before the word (its
    layers ready after it) or after. Without the key nothing is said."""
    services, address = [], None
    for rank in range(2):
        listen = "127.0.0.1:0" if rank == 0 else transfer.rank_address(address, rank)
        peer, at = prefill(
            peers, "--tp-rank", str(rank), "--tp-size", "2", "--listen", listen,
            "--claim-timeout", "600",
        )  # fmt: skip
        address = address or at
        services.append(peer)
    client = peers("decode")
    for request, block in (("kept", 1), ("streaming", 6), ("probe", 2)):
        client.send("claim", request, address, [block], 4, 60)
        assert client.read("claimed") == [request]
    for service in services:
        for request, computed in (("probe", True), ("waiting", True), ("streaming", False)):
            service.send("add", request, [5], 4, computed)
            assert service.read("added") == [request]
    for service in services:  # (so the claims sent before probe's were heard there too)
        assert service.read("outcome", bound=30) == ["probe", True, ""]
    with pytest.raises(SessionError, match="does not hold this deployment's key"):
        transfer.abandon(address, "waiting", "its decode failed", key=b"another key")
    for request in ("waiting", "later", "kept", "streaming"):
        transfer.abandon(address, request, "decode instance http://d1: 502", key=KEY, timeout=10)
    for service in services:
        request, landed, why = service.read("outcome", bound=30)
        assert (request, landed) == ("waiting", False), why
        assert "will never claim it (decode instance http://d1: 502)" in why, why
        service.send("ready", "streaming", 4)
        assert service.read("ready") == ["streaming"]
        for request in ("later", "kept"):
            service.send("add", request, [3], 4)
            assert service.read("added") == [request]
        ended = {}
        for _ in range(3):
            request, landed, why = service.read("outcome", bound=30)
            ended[request] = landed
        assert ended == {"later": False, "kept": True, "streaming": True}
    for request, block in (("kept", 1), ("streaming", 6)):
        client.send("wait", request, [block], 30)
        assert client.read("outcome")[:3] == [True, "", True]


def test_an_abandon_is_refused_at_the_call_for_what_it_cannot_say():
    for args, kwargs, match in (
        (("no-port", "r1", "why"), {"key": KEY}, "prefill"),
        (("127.0.0.1:1", "", "why"), {"key": KEY}, "request_id"),
        (("127.0.0.1:1", "r" * 5000, "why"), {"key": KEY}, "at most 4096"),
        (("127.0.0.1:1", "r1", "why"), {"key": ""}, "key must be non-empty bytes"),
        (("127.0.0.1:1", "r1", "why"), {"key": KEY, "timeout": -1}, "timeout"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            transfer.abandon(*args, **kwargs)


def test_an_abandon_tells_every_rank_named_though_one_cannot_be_told(peers):
    """Every rank's address given, rank 0's service gone: rank 1 is told all the same
    (its request fails now), and the SessionError names rank 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"  # (nothing listens there)
    rank1, address = prefill(peers, "--tp-rank", "1", "--tp-size", "2", "--claim-timeout", "600")
    rank1.send("add", "r1", [5], 4)
    assert rank1.read("added") == ["r1"]
    with pytest.raises(SessionError, match=f"cannot reach the session service at {gone}"):
        transfer.abandon([gone, address], "r1", "its decode failed", key=KEY, timeout=10)
    request, landed, why = rank1.read("outcome", bound=30)
    assert (request, landed) == ("r1", False) and "its decode failed" in why, why


def test_a_service_that_needs_one_block_size_refuses_another_naming_both(caches, receiver):
    """same_block_size: a decode side of blocks of 2 tokens is refused at its hello by a
    service of blocks of 4 (an engine whose caches do not keep a head's tokens in order)."""
    service = transfer.PrefillService(caches, 4, key=KEY, kv_heads=KV_HEADS, same_block_size=True)
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=2)
    try:
        with pytest.raises(pdhal.RefusedError, match="block size \\(tokens\\): 4 here, 2 there"):
            client.connect(service.address)
    finally:
        client.close()
        service.close()


def test_a_pair_of_memory_kinds_the_transport_does_not_move_is_refused_at_the_hello(
    caches, monkeypatch
):
    """A transport declares the pairs of memory kinds it moves (Transport.pairs): here
    host memory into a GPU's only. Each side's caches are a kind it serves (host memory),
    so each side alone is accepted; the decode side's hello is refused, naming both sides
    and both kinds, before any claim. The same transport declaring host into host too
    pairs them."""
    from pdhal._transfer import plugins
    from pdhal._transfer.shm import ShmTransport

    class HostToGpu(ShmTransport):
        name = "host-to-gpu"
        memory = ("cpu", "gpu")
        pairs = (("cpu", "gpu"),)

    monkeypatch.setitem(plugins._instances, "host-to-gpu", HostToGpu())
    receiver = transfer.KVReceiver(caches, f"pairs-{os.getpid()}", transport_name="host-to-gpu")
    service = transfer.PrefillService(
        caches, 4, key=KEY, kv_heads=KV_HEADS, transport_name="host-to-gpu"
    )
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4)
    try:
        with pytest.raises(pdhal.RefusedError) as refused:
            client.connect(service.address)
        text = str(refused.value)
        assert "the prefill side (rank 0 of 1" in text and "the decode side (rank 0 of 1" in text
        assert (
            "this side's caches are cpu memory and the destination's cpu memory: transport "
            "'host-to-gpu' moves cpu to gpu"
        ) in text
    finally:
        client.close()
        service.close()
    monkeypatch.setattr(HostToGpu, "pairs", (("cpu", "gpu"), ("cpu", "cpu")))
    service = transfer.PrefillService(
        caches, 4, key=KEY, kv_heads=KV_HEADS, transport_name="host-to-gpu"
    )
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=KV_HEADS, block_tokens=4)
    try:
        client.connect(service.address)  # welcomed
    finally:
        client.close()
        service.close()
        receiver.close()


@pytest.mark.parametrize("decode_tokens", [2, 8])
def test_a_decode_side_of_another_block_size_gets_each_token_where_its_blocks_hold_it(
    peers, decode_tokens
):
    """Prefill blocks of 4 tokens, decode blocks of 2 (or 8), a head's token the same 4
    bytes on both: the hello pairs them, and each decode block holds, head by head, the
    tokens of the prefill blocks they came from (blocks of 8: the first half from one,
    the second from the next)."""
    service, address = prefill(peers)
    client = peers(
        "decode", "--block-tokens", str(decode_tokens), "--head-bytes", str(decode_tokens * 4)
    )
    blocks = [4, 0, 6, 2] if decode_tokens == 2 else [3]
    client.send("claim", "r1", address, blocks, 8, 30)
    assert client.read("claimed") == ["r1"]
    service.send("add", "r1", [2, 5], 8)
    assert service.read("added") == ["r1"]
    assert service.read("outcome", bound=30) == ["r1", True, ""]
    client.send("wait", "r1", blocks, 30)
    landed, reason, free, got = client.read("outcome")
    assert (landed, reason, free) == (True, "", True)
    sources = [2, 2, 5, 5] if decode_tokens == 2 else [2]  # where each block's tokens began
    for src, layers in zip(sources, got):
        for layer in range(LAYERS):
            for cache in range(CACHES):
                for head, first, uniform in layers[layer][cache]:
                    assert first == value(layer, cache, src, head), (src, layer, cache, head)
                    assert uniform == (decode_tokens == 2)  # of 8: two source blocks
