"""KVReceiver and the shm transport against careless callers and hostile peers: a close
under threads that use the receiver, a wait's deadline, an endpoint name taken twice,
tickets bound to their receiver, a peer's description that lies about its regions or is
garbage, the decode side's mappings a prefill process drops when it closes, request ids that
are not strs. A peer is a real process."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import pdhal
from pdhal import ops, transfer
from pdhal.testing.fixtures import python_child, run_child
from pdhal.testing.transfer_peers import BLOCK_TOKENS, mapped_from, source_caches

BLOCKS, BLOCK_BYTES = 8, 64


@pytest.fixture
def host_layout():
    """A one-layer, one-cache layout in host_alloc memory (what shm can share)."""
    buffers = []

    def make() -> transfer.CacheLayout:
        buffers.append(ops.host_alloc(BLOCKS * BLOCK_BYTES))
        return transfer.CacheLayout.from_caches(
            [[buffers[-1].as_numpy("uint8", (BLOCKS, BLOCK_BYTES))]]
        )

    yield make
    for buf in buffers:
        ops.host_free(buf)


# ---- 1: close() under threads that use the receiver -----------------------------------------


def test_close_under_threads_in_wait_poll_and_layers_landed_is_a_closed_handle_error():
    """Threads loop in poll(), layers_landed() and wait() (one blocked on a request far from
    its deadline) while another thread closes the receiver: each ends with ClosedHandleError
    ("the receiver was closed"), none crashes the process or sees a builtin error; close()
    returns every request still expected as failed, once; a second close() returns [];
    expect() and describe() afterwards are refused. In a child process, since a release of
    the status view under a reader used to kill the process (SIGSEGV)."""
    run_child("""
        import threading
        import pdhal
        from pdhal import ops, transfer

        for round_ in range(5):
            buf = ops.host_alloc(8 * 64)
            layout = transfer.CacheLayout.from_caches([[buf.as_numpy("uint8", (8, 64))]])
            receiver = transfer.KVReceiver(layout, f"closing{round_}", slots=64)
            for i in range(16):
                receiver.expect(f"r{i}", 600, layerwise=i % 2 == 0)
            calls = [receiver.poll] * 3
            calls += [lambda i=i: receiver.layers_landed(f"r{i}") for i in range(3)]
            calls += [lambda i=i: receiver.wait(f"r{i + 3}", 1e-4) for i in range(3)]
            calls += [lambda: receiver.wait("r15", 60)]  # blocked, its deadline far away
            started = threading.Barrier(len(calls) + 1)
            errors = []

            def loop(call):
                started.wait()
                try:
                    while True:
                        call()
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=loop, args=(c,)) for c in calls]
            for t in threads:
                t.start()
            started.wait()
            ended = receiver.close()
            for t in threads:
                t.join(30)
                assert not t.is_alive(), "a call went on after close()"
            assert len(errors) == len(calls), errors
            for e in errors:
                assert type(e) is pdhal.ClosedHandleError, repr(e)
                assert str(e) == "the receiver was closed", e
            assert sorted(o.request_id for o in ended) == sorted(f"r{i}" for i in range(16))
            assert all(not o.landed and o.reason == "the receiver was closed" for o in ended)
            assert receiver.close() == []
            for late in (lambda: receiver.expect("x", 1), receiver.describe, receiver.poll):
                try:
                    late()
                    raise AssertionError("a closed receiver answered")
                except pdhal.ClosedHandleError as e:
                    assert str(e) == "the receiver was closed", e
            ops.host_free(buf)
    """)


# ---- 2: wait() ends at the request's deadline -------------------------------------------------


def test_wait_returns_by_the_deadline_not_a_poll_interval_after_it(host_layout):
    """wait() with a poll_interval far longer than the time left sleeps only until the
    request's deadline: it returns the failure within 2 s of it. A poll_interval that is
    not a positive number of seconds is refused."""
    receiver = transfer.KVReceiver(host_layout(), "deadline", slots=4)
    try:
        receiver.expect("a", 0.2)
        deadline = time.monotonic() + 0.2
        outcome = receiver.wait("a", poll_interval=60)
        assert time.monotonic() < deadline + 2.0, "wait() slept past the deadline"
        assert not outcome.landed and "nothing landed within 0.2 s" in outcome.reason
        receiver.expect("b", 30)
        for bad in (-1, 0, float("nan"), "0.1", None, True, 1e9):
            with pytest.raises(pdhal.InvalidArgumentError, match="poll_interval"):
                receiver.wait("b", poll_interval=bad)
    finally:
        receiver.close()


# ---- 3: an endpoint name is unique on its host ----------------------------------------------


def test_a_live_endpoint_name_is_refused_in_this_process_and_from_another(host_layout, decode):
    """A second receiver of a name a live receiver serves, in this process or in another,
    is a ChannelBusyError naming it (it used to take the name over in-process, and be handed
    the first one's transfers); so is a second shm endpoint of one name. Once the first is
    closed the name is free again."""
    first = transfer.KVReceiver(host_layout(), "taken", slots=4)
    try:
        with pytest.raises(pdhal.ChannelBusyError, match="'taken'"):
            transfer.KVReceiver(host_layout(), "taken", slots=4)
        ticket = first.expect("a", 30)  # the first one still serves
        assert ticket["request"] == "a"
    finally:
        first.close()
    again = transfer.KVReceiver(host_layout(), "taken", slots=4)
    again.close()
    with pytest.raises(pdhal.ChannelBusyError, match="'decode'"):  # another process's name
        transfer.KVReceiver(host_layout(), "decode", slots=4)
    buf = ops.host_alloc(4096)
    shm = transfer.transport("shm")
    endpoint = shm.endpoint([buf], "raw")
    try:
        with pytest.raises(pdhal.ChannelBusyError, match="'raw'"):
            shm.endpoint([buf], "raw")
    finally:
        endpoint.close()
        ops.host_free(buf)


# ---- 4: tickets name their receiver -----------------------------------------------------------


def test_every_ticket_carries_its_receiver_s_token_and_its_request(host_layout, decode):
    """describe() holds "receiver", a random token made once per receiver; every ticket
    holds the same token and its request id, through JSON, so a prefill side can refuse a
    ticket meant for another receiver or another request."""
    receiver = transfer.KVReceiver(host_layout(), "tokens", slots=4)
    try:
        token = receiver.describe()["receiver"]
        assert isinstance(token, str) and len(token) == 32 and int(token, 16) >= 0
        assert receiver.describe()["receiver"] == token
        tickets = [json.loads(json.dumps(receiver.expect(r, 30))) for r in ("a", "b")]
        assert [t["receiver"] for t in tickets] == [token, token]
        assert [t["request"] for t in tickets] == ["a", "b"]
        other = decode.described["receiver"]  # another process's receiver
        assert other != token and decode.expect("a")["receiver"] == other
    finally:
        receiver.close()


# ---- 5: a peer's description is checked before a byte moves ---------------------------------

LIAR = """
    import json, sys
    from pdhal import ops, transfer
    buf = ops.host_alloc(4096)
    endpoint = transfer.transport("shm").endpoint([buf], "liar")
    print(json.dumps(endpoint.describe()), flush=True)
    sys.stdin.readline()
    endpoint.close()
    ops.host_free(buf)
"""


@pytest.fixture
def liar():
    """A process serving one region of 4096 bytes as "liar"; its true description."""
    proc = python_child(LIAR, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, f"the peer exited ({proc.wait()})"
    yield json.loads(line)
    proc.stdin.write("\n")
    proc.stdin.close()
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0


def _garbage(described: dict) -> list[tuple[dict, str]]:
    def but(**changes) -> dict:
        return {**described, **changes}

    return [
        (but(regions=[1 << 20]), "region 0 .*1048576 bytes.* 4096 bytes"),
        (but(regions=[4095]), "region 0 .*4095 bytes.* 4096 bytes"),
        (but(pid=2**70), "pid"),
        (but(pid=-1), "pid"),
        (but(pid="x"), "pid"),
        (but(pid=True), "pid"),
        (but(started=12), "started"),
        (but(namespace="theirs"), "namespace 'theirs', this process in 't"),
        (but(namespace=None), "namespace None"),
        (but(names="liar.r0"), "names must be a list"),
        (but(names=[described["names"][0], "liar.r1"]), "2 regions but sizes 1"),
        (but(names=[3]), r"names\[0\]"),
        (but(regions=[-4096]), r"regions\[0\]"),
        (but(regions=[True]), r"regions\[0\]"),
        (but(regions=[4096.0]), r"regions\[0\]"),
        (but(regions=4096), "regions must be a list"),
        ({k: v for k, v in described.items() if k != "pid"}, "lacks pid"),
        ({k: v for k, v in described.items() if k != "namespace"}, "lacks namespace"),
        ("not a dict", "must be a dict"),
    ]


def test_a_description_claiming_more_than_its_peer_shares_is_refused(liar):
    """A peer that shares 4096 bytes and describes 1 MiB (which made a link copy past the
    mapping: SIGSEGV), or describes garbage, is refused at connect with an
    InvalidArgumentError naming what was wrong, never a builtin error (one of another
    namespace too, naming both: the description says its own); its true description
    connects and copies."""
    assert liar["namespace"] == pdhal.namespace()
    shm = transfer.transport("shm")
    src = ops.host_alloc(4096)
    try:
        for described, why in _garbage(liar):
            with pytest.raises(pdhal.InvalidArgumentError, match=why):
                shm.connect(described, [(src.address, src.nbytes)]).close()
        link = shm.connect(liar, [(src.address, src.nbytes)])
        link.submit([(src.address, 0, 0, 4096)]).wait(5)
        link.close()
        with pytest.raises(pdhal.TransferError, match="closed"):
            link.submit([(src.address, 0, 0, 4096)])
    finally:
        ops.host_free(src)


# ---- 6: a prefill process drops the decode side's mappings when it closes -------------------


def test_closing_the_last_link_unmaps_the_decode_side(decode):
    """Links to a decode process map its caches; closing one of two leaves them mapped for
    the other (which still copies), closing the last unmaps them: nothing of the decode
    side stays in /proc/self/maps (a prefill process used to keep every cache it ever
    wrote to)."""
    shm = transfer.transport("shm")
    src = ops.host_alloc(4096)
    try:
        first = shm.connect(decode.described, [(src.address, src.nbytes)])
        second = shm.connect(decode.described, [(src.address, src.nbytes)])
        assert mapped_from(decode.proc.pid)
        first.close()
        assert mapped_from(decode.proc.pid)
        second.submit([(src.address, 0, 0, BLOCK_BYTES)]).wait(5)
        second.close()
        assert mapped_from(decode.proc.pid) == []
    finally:
        ops.host_free(src)


def test_closing_a_streamer_unmaps_the_decode_side(decode):
    """A KVStreamer that sent a request to a decode process leaves none of the decode
    side's memory mapped once it is closed."""
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(source_caches()), BLOCK_TOKENS, claim_timeout=30
    )
    try:
        dest = streamer.connect(decode.described)
        assert mapped_from(decode.proc.pid)
        streamer.add_request("a", [1], BLOCK_TOKENS)
        streamer.set_destination("a", dest, [2], decode.expect("a"))
    finally:
        streamer.close()
    assert mapped_from(decode.proc.pid) == []


# ---- 7: request ids are strs --------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, None, b"a", ["a"], ("a",), {"a": 1}, ""])
def test_a_request_id_that_is_not_a_str_is_refused(host_layout, bad):
    """expect, layers_landed and wait refuse a request id that is not a non-empty str
    (unhashable ones included) with InvalidArgumentError, never TypeError or KeyError."""
    receiver = transfer.KVReceiver(host_layout(), "ids", slots=4)
    try:
        receiver.expect("a", 30)
        for call in (
            lambda: receiver.expect(bad, 30),
            lambda: receiver.layers_landed(bad),
            lambda: receiver.wait(bad),
        ):
            with pytest.raises(pdhal.InvalidArgumentError, match="request_id"):
                call()
        assert receiver.poll() == []
    finally:
        receiver.close()


# ---- no write after give-up ---------------------------------------------------------------


def test_a_request_failed_by_its_deadline_holds_its_slot_until_released(host_layout):
    """A request whose deadline passed with nothing written is reported failed with
    blocks_free False and stays held: its id cannot be expected again and its slot is not
    handed out (a late write of it must meet nobody else's request), until release() lets
    it go, once (freed() names it once); release() of a request not held is refused. The
    slot then goes to the back of the queue."""
    receiver = transfer.KVReceiver(host_layout(), "held", slots=2)
    try:
        first = receiver.expect("late", 0.05)
        [outcome] = [receiver.wait("late")]
        assert not outcome.landed and outcome.blocks_free is False
        assert receiver.held() == ["late"] and receiver.freed() == []
        with pytest.raises(pdhal.InvalidArgumentError, match="blocks are still held"):
            receiver.expect("late", 1)
        other = receiver.expect("other", 30)
        assert other["slot"] != first["slot"]
        with pytest.raises(pdhal.InvalidArgumentError, match="all 2 status slots"):
            receiver.expect("third", 30)  # the held slot is not handed out
        with pytest.raises(pdhal.InvalidArgumentError, match="'other' is not held"):
            receiver.release("other")
        receiver.release("late")
        assert receiver.freed() == ["late"] and receiver.freed() == []
        assert receiver.held() == []
        again = receiver.expect("late", 30)
        assert again["slot"] == first["slot"] and again["generation"] > first["generation"]
    finally:
        receiver.close()
