"""What the streamer's contract promises where the other transfer tests did not look (each
test here kills a mutant of tests/mutation/mutants.toml that survived them): a request
failed by a broken link is reported only once its writes settled; a late failure on a
link already broken breaks nothing sent after the break; the writes behind a stalled one
wait only what is left of their own stall_timeout; a failed request's queued layers are
not written; a decode side that dies after its first peer check is still found, by the
streamer's own clock, which wakes for a deadline nearer than the one it sleeps to. The
decode side is another process; the faults are the test-only `faulty` transport's, some
of them gated or recorded here."""

from __future__ import annotations

import threading

import pdhal
from pdhal import transfer
from pdhal.testing.transfer_peers import (
    BLOCK_TOKENS,
    LAYERS,
    expected,
    landed_blocks,
    source_caches,
)

#: How long an outcome promised "at once" may take on a loaded machine: a liveness bound,
#: never a measure (each is promised within far less).
BOUND_S = 20.0


class Heard:
    """The outcomes an on_outcome callback hears, waited for on a condition (no polling)."""

    def __init__(self, then=None):
        self.outcomes: dict[str, transfer.Outcome] = {}
        self._cond = threading.Condition()
        self._then = then

    def __call__(self, outcome: transfer.Outcome) -> None:
        if self._then is not None:
            self._then(outcome)
        with self._cond:
            self.outcomes[outcome.request_id] = outcome
            self._cond.notify_all()

    def wait(self, *request_ids: str, bound: float = BOUND_S) -> dict[str, transfer.Outcome]:
        with self._cond:
            ended = self._cond.wait_for(
                lambda: all(r in self.outcomes for r in request_ids), timeout=bound
            )
            assert ended, f"only {sorted(self.outcomes)} of {request_ids} ended"
            return dict(self.outcomes)


def streamer_of(**options) -> transfer.KVStreamer:
    options.setdefault("claim_timeout", 30)
    return transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, **options
    )


def test_a_request_failed_by_a_broken_link_is_reported_only_once_its_writes_settled(decode, faulty):
    """All three layers of "a" stall. The first stall breaks the decode side and fails "a"
    (its decode side is not told: the link is gone), but the two writes behind it are still
    in flight: "a" is reported only once they settled too (each write's layer record is in
    the metrics before its request moves on), so the engine never frees source blocks a
    write may still read."""
    faulty("stall:1,stall:2,stall:3")
    at_outcome = []
    heard = Heard(lambda outcome: at_outcome.append(len(streamer.metrics.layers())))
    streamer = streamer_of(transport_name="faulty", stall_timeout=1.0, on_outcome=heard)
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("a", [0], 4)
        streamer.set_destination("a", dest, [0], decode.expect("a"))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        outcome = heard.wait("a")["a"]
        assert not outcome.landed and "injected stall" in outcome.reason
    finally:
        streamer.close()
    settled = len(streamer.metrics.layers())
    assert settled >= 1
    assert at_outcome == [settled], "reported while a write of it was still in flight"


def test_a_late_failure_on_a_broken_link_fails_nothing_sent_after_the_break(decode, faulty):
    """ "a" and "b" each have a layer in flight, both stalled. The first stall breaks the
    decode side: "a", "b" and "idle" (claimed, nothing sent) fail. Told of "idle" (on the
    thread that broke the link, so before "b"'s write settles), the engine sends "c" there:
    it goes over a new link. "b"'s write then fails late, on the old link: that breaks
    nothing new, and "c" lands on both sides."""
    faulty("stall:1,stall:2")
    tickets = {}

    def send_c(outcome):
        if outcome.request_id == "idle":  # the link broke just now: "c" goes after it
            streamer.set_destination("c", dest, [3], tickets["c"])
            claimed.set()

    claimed = threading.Event()
    heard = Heard(send_c)
    streamer = streamer_of(transport_name="faulty", stall_timeout=0.5, on_outcome=heard)
    try:
        dest = streamer.connect(decode.described)
        for block, request in enumerate(("a", "b", "idle", "c")):
            tickets[request] = decode.expect(request)
            streamer.add_request(request, [block], 4)
        for block, request in enumerate(("a", "b", "idle")):
            streamer.set_destination(request, dest, [block], tickets[request])
        streamer.layer_ready(0, [("a", 4)])
        streamer.layer_ready(0, [("b", 4)])
        ended = heard.wait("a", "b", "idle")
        assert all(not ended[r].landed and "injected stall" in ended[r].reason for r in ("a", "b"))
        assert claimed.is_set(), "c was not sent there (the on_outcome callback failed)"
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("c", 4)])
        outcome = heard.wait("c")["c"]
        assert outcome == transfer.Outcome("c", True), outcome
        landed, reason, dump, _ = decode.wait("c")
        assert landed, reason
        assert landed_blocks(dump, 3) == expected(3)
    finally:
        streamer.close()


def test_writes_behind_a_stalled_one_wait_only_what_is_left_of_their_stall_timeout(
    decode, faulty, monkeypatch
):
    """All three layers of "a" stall, submitted together. Each write is waited for only
    until stall_timeout after its own submit: the first for less than stall_timeout, and
    the two behind it, whose stall_timeout ran while they queued behind it, for no more
    than what is left of theirs; never a whole stall_timeout again, so whatever was in
    flight ends within 2 x stall_timeout. (The faulty transport's stalled batch sleeps the
    bound it is given: it is recorded here.)"""
    module = faulty("stall:1,stall:2,stall:3")
    bounds = []
    stalled_wait = module._Stalled.wait

    def recorded(batch, timeout):
        bounds.append(timeout)
        return stalled_wait(batch, timeout)

    monkeypatch.setattr(module._Stalled, "wait", recorded)
    heard = Heard()
    streamer = streamer_of(transport_name="faulty", stall_timeout=1.0, on_outcome=heard)
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("a", [0], 4)
        streamer.set_destination("a", dest, [0], decode.expect("a"))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        outcome = heard.wait("a")["a"]
        assert not outcome.landed and "injected stall" in outcome.reason
    finally:
        streamer.close()
    assert bounds, "no write stalled"
    assert all(bound < 1.0 for bound in bounds), bounds


def test_the_queued_layers_of_a_request_failed_meanwhile_are_not_written(
    decode, faulty, monkeypatch
):
    """One layer in flight at most; "a"'s layer 0 is submitted (its bytes land only once
    this test lets its wait go on), layers 1 and 2 queue behind it. fail("a") then: once
    layer 0 settled, the queued layers, which no live request needs, are dropped unsent.
    The decode side reads FAILED with the reason; its block holds layer 0's bytes (which
    landed before the word) and nothing of layers 1 and 2, even once the streamer closed."""
    module = faulty("delay:1")
    waiting, gate = threading.Event(), threading.Event()
    delayed_wait = module._Delayed.wait

    def gated(batch, timeout):
        waiting.set()  # layer 0 was submitted: the window of one is full
        assert gate.wait(BOUND_S), "the test never let the write go on"
        return delayed_wait(batch, timeout)

    monkeypatch.setattr(module._Delayed, "wait", gated)
    heard = Heard()
    streamer = streamer_of(transport_name="faulty", max_layers_in_flight=1, on_outcome=heard)
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("a", [0], 4)
        streamer.set_destination("a", dest, [5], decode.expect("a"))
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        assert waiting.wait(BOUND_S), "layer 0 was never submitted"
        streamer.fail("a", "given up")
        gate.set()
        assert heard.wait("a")["a"] == transfer.Outcome("a", False, "given up")
        landed, reason, _, _ = decode.wait("a")
        assert not landed and reason == "given up"
    finally:
        gate.set()
        streamer.close()
    caches = len(expected(0)[0])
    block = [[decode.block(layer, c, 5)[0] for c in range(caches)] for layer in range(LAYERS)]
    assert block == [expected(0)[0], [0] * caches, [0] * caches], "a dropped layer was written"


def test_a_decode_side_killed_after_its_first_peer_check_is_found_by_the_streamer_s_clock(
    decode, namespace
):
    """A messager hearing outcomes through on_outcome never polls; the claim leases are an
    hour away, and the streamer's clock sleeps to the first of them when the two requests
    are claimed: it must wake for their nearer deadlines. "sync" is claimed after
    "doomed", so its ticket's deadline (0.5 s) comes after the first peer check of their
    decode side (the clock runs its jobs in deadline order): once "sync" ended, that check
    ran. The decode process is killed only then: the next checks find it gone, and
    "doomed" fails naming that, long before its own ticket's deadline."""
    heard = Heard()
    streamer = streamer_of(claim_timeout=3600, on_outcome=heard)
    try:
        streamer.add_request("doomed", [0], 4)  # the clock sleeps to its lease, an hour away
        streamer.add_request("sync", [1], 4)
        dest = streamer.connect(decode.described)
        doomed, sync = decode.expect("doomed", timeout=60), decode.expect("sync", timeout=0.5)
        streamer.set_destination("doomed", dest, [0], doomed)  # its first peer check: nearer
        streamer.set_destination("sync", dest, [1], sync)
        outcome = heard.wait("sync")["sync"]
        assert not outcome.landed and "deadline (0.5 s) passed" in outcome.reason
        assert "doomed" not in heard.outcomes
        decode.kill()
        outcome = heard.wait("doomed")["doomed"]
        assert not outcome.landed and "is gone" in outcome.reason, outcome
    finally:
        streamer.close()
        pdhal.cleanup(namespace)  # what the killed decode process left
