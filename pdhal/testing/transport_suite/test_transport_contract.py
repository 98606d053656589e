"""The transport contract (pdhal.transfer.Transport), checked against a destination in
another process: every byte of many runs lands where it was sent, later submits land over
earlier ones, a run outside the destination is refused with nothing written, a dead peer
is reported, a stopped one never hangs a wait past its timeout, and connecting and closing
leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import random
import time

import numpy as np
import pytest

import pdhal
from pdhal import TransferError


def _source(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def test_every_byte_of_many_runs_lands_where_it_was_sent(transport, destination):
    """200 runs of random sizes from random places, to places of their own (runs in flight
    together never overlap in the destination: the order they land in is the transport's),
    in four submits in flight at once."""
    sizes = [64 * 1024, 3 * 4096 + 17]
    dest = destination(sizes)
    source = _source(256 * 1024, seed=1)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        expect = [np.zeros(n, np.uint8) for n in sizes]
        rng, runs = random.Random(2), []
        places = [(r, at) for r, n in enumerate(sizes) for at in range(0, n - 256, 256)]
        for region, offset in rng.sample(places, 200):
            nbytes = rng.randrange(1, 257)
            src = rng.randrange(0, source.nbytes - nbytes)
            runs.append((source.ctypes.data + src, region, offset, nbytes))
            expect[region][offset : offset + nbytes] = source[src : src + nbytes]
        batches = [link.submit(runs[first : first + 50]) for first in range(0, len(runs), 50)]
        for batch in batches:  # several submits in flight together
            batch.wait(30.0)
        assert dest.digests() == [_digest(e) for e in expect]
    finally:
        link.close()


def test_a_later_submit_lands_over_an_earlier_one(transport, destination):
    """Two submits to the same bytes, both waited for: the destination holds the second."""
    dest = destination([4096])
    first, second = _source(4096, seed=3), _source(4096, seed=4)
    sources = [(a.ctypes.data, a.nbytes) for a in (first, second)]
    link = transport.connect(dest.described, sources)
    try:
        one = link.submit([(first.ctypes.data, 0, 0, 4096)])
        one.wait(30.0)
        two = link.submit([(second.ctypes.data, 0, 0, 4096)])
        two.wait(30.0)
        assert one.done() and two.done()
        assert dest.digests() == [_digest(second)]
    finally:
        link.close()


@pytest.mark.parametrize(
    "region, offset, nbytes",
    [(0, 4000, 200), (1, 0, 8), (0, 4096, 1)],
    ids=["past", "region", "end"],
)
def test_a_run_outside_the_destination_fails_and_writes_nothing(
    transport, destination, region, offset, nbytes
):
    dest = destination([4096])
    source = _source(4096, seed=5)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        good = (source.ctypes.data, 0, 0, 16)
        with pytest.raises(TransferError, match="outside"):
            link.submit([good, (source.ctypes.data, region, offset, nbytes)]).wait(30.0)
        assert dest.digests() == [_digest(np.zeros(4096, np.uint8))], "a refused submit wrote"
    finally:
        link.close()


def test_a_source_outside_the_memory_given_is_refused(transport, destination):
    """A run from memory the link was not given (to register) fails, never reads it."""
    dest = destination([4096])
    source, other = _source(4096, seed=10), _source(4096, seed=11)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        with pytest.raises(TransferError, match="outside the memory"):
            link.submit([(other.ctypes.data, 0, 0, 64)]).wait(30.0)
        with pytest.raises(TransferError, match="outside the memory"):
            link.submit([(source.ctypes.data + 4090, 0, 0, 64)]).wait(30.0)
        assert dest.digests() == [_digest(np.zeros(4096, np.uint8))]
    finally:
        link.close()


def test_a_dead_peer_is_reported_and_its_leftovers_are_its_own(transport, destination, namespace):
    """SIGKILL the destination: within a bound, a submit to it fails (at submit or in its
    wait), and the link's problem() says so from then on."""
    dest = destination([4096])
    source = _source(4096, seed=6)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        link.submit([(source.ctypes.data, 0, 0, 4096)]).wait(30.0)
        assert link.problem() is None
        dest.kill()
        deadline, failed = time.monotonic() + 30.0, None
        while failed is None:
            assert time.monotonic() < deadline, "writes to a dead peer kept landing"
            try:
                link.submit([(source.ctypes.data, 0, 0, 4096)]).wait(2.0)
            except TransferError as e:
                failed = str(e)
        assert failed
        assert link.problem() is not None, "the link forgot its peer is dead"
    finally:
        link.close()
    removed, left = pdhal.cleanup(namespace)
    assert left == [] and all(f".{dest.proc.pid}." in p or "kitdest" in p for p in removed)


def test_a_stopped_peer_never_holds_a_wait_past_its_timeout(transport, destination):
    """SIGSTOP the destination: a submit either lands or fails within its wait's timeout."""
    dest = destination([1 << 20])
    source = _source(1 << 20, seed=7)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        dest.stop()
        started = time.monotonic()
        try:
            link.submit([(source.ctypes.data, 0, 0, 1 << 20)]).wait(2.0)
        except TransferError:
            pass
        assert time.monotonic() - started < 30.0, "a wait outlived its timeout"
        dest.resume()
        link.submit([(source.ctypes.data, 0, 0, 1 << 20)]).wait(30.0)
        assert dest.digests() == [_digest(source)]
    finally:
        link.close()


def test_connecting_and_closing_again_and_again_leaks_nothing(transport, destination):
    dest = destination([4096])
    source = _source(4096, seed=8)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def cycle():
        link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
        link.submit([(source.ctypes.data, 0, 0, 64)]).wait(30.0)
        link.close()

    cycle()
    before = fds()
    for _ in range(30):
        cycle()
    assert fds() == before


def test_a_link_is_used_from_several_threads_at_once(transport, destination):
    """The streamer submits from its caller's thread and asks problem() from there and from
    each completion thread: concurrent calls must all work, every byte landing."""
    import threading

    dest = destination([8 * 4096])
    source = _source(8 * 4096, seed=9)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    errors = []

    def hammer(part: int):
        try:
            for _ in range(300):
                assert link.problem() is None
                offset = part * 4096
                link.submit([(source.ctypes.data + offset, 0, offset, 4096)]).wait(30.0)
        except Exception as e:  # reported below, with the thread's part
            errors.append(f"part {part}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=hammer, args=(part,)) for part in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert dest.digests() == [_digest(source)]
    finally:
        link.close()
