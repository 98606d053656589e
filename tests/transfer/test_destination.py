"""A Destination's order and threads: a transport that posts (Transport.posts) is submitted
to on the caller's thread while nothing is queued before the write, and on the submitting
thread otherwise; either way writes are submitted and settled in the order they were put."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pdhal import BatchFailedError, TransferError
from pdhal._transfer.contract import Batch, Link
from pdhal._transfer.destination import Destination, Send

#: A stop that settles everything takes milliseconds; a bug that leaves a write unsettled
#: fails at this bound (ten seconds is ample on a loaded machine, and a mutant's run is short).
STOP_BOUND_S = 10.0


class HeldBatch(Batch):
    def __init__(self):
        self.landed = threading.Event()

    def done(self) -> bool:
        return self.landed.is_set()

    def wait(self, timeout: float) -> None:
        if not self.landed.wait(timeout):
            raise TransferError(f"not landed within {timeout:g} s")


class RecordingLink(Link):
    """Each submit's layer and the thread it came on; its batches land when told."""

    regions = [1 << 20]

    def __init__(self):
        self.submits, self.batches = [], []
        self.gate = self.entered = None  # Events: the submitting thread's submits wait

    def submit_blocks(self, layer, runs) -> Batch:
        thread = threading.current_thread().name
        if self.gate is not None and thread == "pdhal-transfer-submit":
            self.entered.set()
            self.gate.wait(60)
        self.submits.append((layer, thread))  # once its copies would be queued
        self.batches.append(HeldBatch())
        return self.batches[-1]

    def submit(self, runs) -> Batch:
        raise AssertionError("a Send goes through submit_blocks")


def _over(connect, window: int, settled, broken, posts: bool = False) -> Destination:
    """A Destination over the links `connect` makes, each layer's copies the layer itself."""
    return Destination(
        connect,
        SimpleNamespace(layer=lambda index: index),  # what the link is handed per layer
        status_region=1,
        status_slots=1,
        receiver="r",
        window=window,
        stall_timeout=60.0,
        settled=settled,
        broken=broken,
        posts=posts,
    )


def _land(link: RecordingLink, index: int) -> None:
    """Land the link's batch `index` once it was submitted (within 60 s)."""
    deadline = time.monotonic() + 60
    while len(link.batches) <= index:
        assert time.monotonic() < deadline, f"write {index} was never submitted"
        time.sleep(0.001)
    link.batches[index].landed.set()


def _destination(posts: bool, window: int):
    link, settled, all_settled = RecordingLink(), [], threading.Event()

    def on_settled(dest, write, reason):
        settled.append((write.layer, reason))
        if len(settled) == 4:
            all_settled.set()

    dest = _over(
        lambda status: link,
        window=window,
        settled=on_settled,
        broken=lambda dest, epoch, reason: None,
        posts=posts,
    )
    return dest, link, settled, all_settled


@pytest.mark.parametrize("posts", [True, False], ids=["posts", "submits"])
def test_writes_are_submitted_and_settled_in_the_order_they_were_put(posts):
    dest, link, settled, all_settled = _destination(posts, window=2)
    request = SimpleNamespace(live=True)
    caller = threading.current_thread().name
    try:
        for layer in range(4):  # the window holds two: layers 2 and 3 wait for room
            dest.put(Send(layer=layer, items=[(request, 1)]))
        submitted = link.submits[:2]
        if posts:  # put with nothing before them and room: submitted on the caller's thread
            assert submitted == [(0, caller), (1, caller)]
        for index in range(4):  # each submitted once a place is free
            _land(link, index)
        assert all_settled.wait(60)
        assert [layer for layer, _ in link.submits] == [0, 1, 2, 3]
        assert [thread for _, thread in link.submits[2:]] == ["pdhal-transfer-submit"] * 2
        if not posts:
            assert {thread for _, thread in link.submits} == {"pdhal-transfer-submit"}
        assert settled == [(layer, None) for layer in range(4)]
    finally:
        assert dest.stop(time.monotonic() + STOP_BOUND_S)


def test_a_put_while_the_submitting_thread_submits_waits_behind_it():
    """The submitting thread took a write and is inside the link's submit, with room in the
    window and nothing queued: a put then must not be submitted on the caller's thread
    ahead of it (the link would get them out of order)."""
    dest, link, settled, all_settled = _destination(posts=True, window=2)
    link.gate, link.entered = threading.Event(), threading.Event()
    request = SimpleNamespace(live=True)
    try:
        for layer in range(3):  # 0 and 1 on the caller's thread; 2 waits for room
            dest.put(Send(layer=layer, items=[(request, 1)]))
        link.batches[0].landed.set()  # room: the submitting thread takes layer 2 ...
        assert link.entered.wait(60)  # ... and is inside submit
        link.batches[1].landed.set()  # room again, and nothing queued
        deadline = time.monotonic() + 60
        while len(settled) < 2:  # layer 1's place is free once it settled
            assert time.monotonic() < deadline, "layer 1 never settled"
            time.sleep(0.001)
        dest.put(Send(layer=3, items=[(request, 1)]))
        link.gate.set()
        for index in range(2, 4):
            _land(link, index)
        assert all_settled.wait(60)
        assert [layer for layer, _ in link.submits] == [0, 1, 2, 3]
        assert settled == [(layer, None) for layer in range(4)]
    finally:
        assert dest.stop(time.monotonic() + STOP_BOUND_S)


def test_a_put_behind_queued_writes_waits_for_them_though_the_window_has_room(monkeypatch):
    """A write waits in the queue while the window has room again: the submitting thread
    has not taken it yet (under load: not scheduled; here: not started until the test
    says). A put then must queue behind it, not be submitted on the caller's thread ahead
    of it (the link would get them out of order)."""
    start, held = threading.Thread.start, []

    def hold_the_submitting_thread(thread):
        if thread.name == "pdhal-transfer-submit" and not held:
            held.append(thread)
        else:
            start(thread)

    monkeypatch.setattr(threading.Thread, "start", hold_the_submitting_thread)
    dest, link, settled, _ = _destination(posts=True, window=1)
    monkeypatch.setattr(threading.Thread, "start", start)
    request = SimpleNamespace(live=True)
    try:
        dest.put(Send(layer=0, items=[(request, 1)]))  # room, nothing queued: submitted here
        dest.put(Send(layer=1, items=[(request, 1)]))  # no room: queued
        _land(link, 0)
        deadline = time.monotonic() + 60
        while True:  # layer 0 settled and its place is free: room, with layer 1 queued
            with dest._cond:
                if dest._taken == 0:
                    break
            assert time.monotonic() < deadline, "layer 0's place was never freed"
            time.sleep(0.001)
        dest.put(Send(layer=2, items=[(request, 1)]))
        assert [layer for layer, _ in link.submits] == [0]  # 2 waits behind 1
        start(held[0])
        for index in (1, 2):
            _land(link, index)
        while len(settled) < 3:
            assert time.monotonic() < deadline, f"{len(settled)} of 3 settled"
            time.sleep(0.001)
        assert [layer for layer, _ in link.submits] == [0, 1, 2]
        assert settled == [(layer, None) for layer in range(3)]
    finally:
        if held and held[0].ident is None:
            start(held[0])  # (an assertion failed before it was started: stop() joins it)
        for index in range(3):  # (an assertion failed first: nothing is left in flight)
            _land(link, index)
        assert dest.stop(time.monotonic() + STOP_BOUND_S)


class LandedAtOnce(Batch):
    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> None:
        return None


def test_many_writes_put_as_fast_as_possible_keep_their_order():
    """Thousands of writes put through a small window, each landing at once, the caller
    yielding now and then: the window fills and frees over and over, so puts meet every
    state of the two submitting threads (a queue not yet taken, a submit in progress, an
    idle completer); the link still gets them in the order they were put, and every one
    settles."""
    writes, link, settled, done = 3000, RecordingLink(), [], threading.Event()
    link.submit_blocks = lambda layer, runs: link.submits.append(layer) or LandedAtOnce()

    def on_settled(dest, write, reason):
        settled.append((write.layer, reason))
        if len(settled) == writes:
            done.set()

    dest = _over(
        lambda status: link,
        window=2,
        settled=on_settled,
        broken=lambda dest, epoch, reason: None,
        posts=True,
    )
    request = SimpleNamespace(live=True)
    try:
        for layer in range(writes):
            dest.put(Send(layer=layer, items=[(request, 1)]))
            if layer % 3 == 0:
                time.sleep(0)  # the GIL to the other threads: their states interleave with puts
        assert done.wait(60), f"{len(settled)} of {writes} settled"
        assert link.submits == list(range(writes))
        assert settled == [(layer, None) for layer in range(writes)]
    finally:
        assert dest.stop(time.monotonic() + STOP_BOUND_S)


def test_a_followed_send_armed_while_the_destination_stops_is_settled_before_it_ends():
    """arm() is inside its submit when stop() begins: stop waits for it (the link is not
    closed under it) and the send is settled, every thread then ending; a send armed
    after stop began is put as any write, and refused."""
    dest, link, settled, _ = _destination(posts=True, window=2)
    inside, release, closed = threading.Event(), threading.Event(), []

    def submit_blocks(layer, runs, gate=None):
        inside.set()
        release.wait(60)
        batch = HeldBatch()
        batch.landed.set()
        return batch

    link.submit_blocks, link.close = submit_blocks, lambda: closed.append(True)
    request = SimpleNamespace(live=True)
    gate = object()  # (the fake link takes any)
    arming = threading.Thread(
        target=dest.arm, args=(Send(layer=7, items=[(request, 1)], gate=gate),)
    )
    arming.start()
    assert inside.wait(60)
    assert not dest.stop(time.monotonic() + 0.2)  # not while a send is being armed
    assert not closed and settled == []
    release.set()
    arming.join(60)
    assert dest.stop(time.monotonic() + STOP_BOUND_S)
    assert settled == [(7, None)] and closed == [True]
    assert not any(thread.is_alive() for thread in dest._threads)
    dest.arm(Send(layer=8, items=[(request, 1)], gate=gate))
    assert settled[-1] == (8, "the streamer was closed")


class OwnFailure(Batch):
    """A batch whose copies failed on their own, its link sound."""

    def done(self) -> bool:
        raise BatchFailedError("layer 2 failed")

    def wait(self, timeout: float) -> None:
        self.done()


class OwnFailures(RecordingLink):
    """A link whose layer-1 submit raises BatchFailedError and whose layer-2 batch fails
    with it; its other batches land."""

    def submit_blocks(self, layer, runs) -> Batch:
        if layer == 1:
            raise BatchFailedError("layer 1's copies were refused")
        if layer == 2:
            return OwnFailure()
        batch = super().submit_blocks(layer, runs)
        batch.landed.set()
        return batch


def test_a_failure_the_batch_says_is_its_own_settles_its_write_and_keeps_the_link():
    """A transport's submit or batch that raises BatchFailedError fails that write alone
    (settled with the reason), breaks nothing (no request of the destination fails by
    it), and the writes after it go over the same link, where any other failure breaks
    the link."""
    link, settled, broken, connects = OwnFailures(), [], [], []

    def connect(status):
        connects.append(status)
        return link

    dest = _over(
        connect,
        window=1,
        settled=lambda dest, write, reason: settled.append((write.layer, reason)),
        broken=lambda dest, epoch, reason: broken.append(reason),
    )
    request = SimpleNamespace(live=True)
    try:
        for layer in range(4):
            dest.put(Send(layer=layer, items=[(request, 1)]))
    finally:
        assert dest.stop(time.monotonic() + STOP_BOUND_S)
    assert settled == [
        (0, None),
        (1, "layer 1's copies were refused"),
        (2, "layer 2 failed"),
        (3, None),
    ]
    assert broken == [] and len(connects) == 1
