"""The transport contract (pdhal.transfer.Transport), checked against a destination in
another process: every byte of many runs lands where it was sent, later submits land over
earlier ones, a run outside the destination or not made of ints is refused with nothing
written, a garbage description is refused at connect, a dead peer is reported, a stopped
one never hangs a wait past its timeout, and connecting and closing leaves nothing behind.
The completion a transport declares is one pdhal knows, and "target" is proved under load:
a marker written once a batch is done is never read before the batch's bytes."""

from __future__ import annotations

import hashlib
import os
import random
import time

import numpy as np
import pytest

import pdhal
from pdhal import InvalidArgumentError, TransferError
from pdhal.transfer import (
    COMPLETIONS,
    BlockRuns,
    Gate,
    LayerCopies,
    Transport,
    block_runs,
    require_target_completion,
)


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


@pytest.mark.parametrize("strided", [False, True], ids=["whole", "strided"])
def test_block_runs_land_as_their_planned_copies_would(transport, destination, strided):
    """submit_blocks (what the streamer calls per layer) lands exactly the bytes of the
    copies LayerCopies plans for the same block runs, in two caches: whole blocks (one copy
    per run) or strided ones (one per block), the last block of a region included."""
    block, count = 256, 16
    stride = 2 * block if strided else block
    dest = destination([count * block, count * stride])
    source = _source(2 * count * stride, seed=11)
    layer = LayerCopies(
        [
            (source.ctypes.data, stride, 0, 0, block, block),
            (source.ctypes.data + count * stride, stride, 1, 0, stride, block),
        ]
    )
    runs = BlockRuns(block_runs([0, 1, 2, 9, 5], [15, 3, 4, 0, 14]))
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        link.submit_blocks(layer, runs).wait(30.0)
        expect = [np.zeros(count * block, np.uint8), np.zeros(count * stride, np.uint8)]
        for address, region, offset, nbytes in layer.copies(runs.runs):
            at = address - source.ctypes.data
            expect[region][offset : offset + nbytes] = source[at : at + nbytes]
        assert dest.digests() == [_digest(e) for e in expect]
        past = BlockRuns([(0, 0, 1), (0, count, 1)])  # one block past region 0's end
        with pytest.raises(TransferError, match="outside the destination"):
            link.submit_blocks(layer, past)
    finally:
        link.close()
    assert dest.digests() == [_digest(e) for e in expect]  # the refused submit wrote nothing


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


@pytest.mark.parametrize(
    "bad, field",
    [
        (lambda a: (a, 0, 0, -16), "bytes"),
        (lambda a: (a, 0, 0, 0), "bytes"),
        (lambda a: (a, 0, 16.0, 16), "offset"),
        (lambda a: (a, False, 0, 16), "region"),
        (lambda a: (None, 0, 0, 16), "source address"),
        (lambda a: (a, 0, -16, 16), "offset"),
        (lambda a: (a, 0, np.float64(16), 16), "offset"),
        (lambda a: (a, 0, 16), None),
        (lambda a: a, None),
    ],
    ids=["negative", "zero", "float", "bool", "none", "offset", "np-float", "three", "int"],
)
def test_a_run_of_bad_fields_is_refused_and_nothing_is_written(transport, destination, bad, field):
    """A run that is not four ints (anything with __index__ but a bool), at least 1 byte at
    an offset >= 0, is refused naming the run and the field, the good run before it unsent."""
    dest = destination([4096])
    source = _source(4096, seed=12)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        good = (source.ctypes.data, 0, 0, 16)
        what = f"run 1's {field}" if field else "run 1 must be"
        with pytest.raises(InvalidArgumentError, match=what):
            link.submit([good, bad(source.ctypes.data)]).wait(30.0)
        assert dest.digests() == [_digest(np.zeros(4096, np.uint8))], "a refused submit wrote"
        link.submit([good]).wait(30.0)  # the link is still good
        assert link.problem() is None
    finally:
        link.close()


def test_numpy_integers_are_ints_in_a_run(transport, destination):
    dest = destination([4096])
    source = _source(4096, seed=13)
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    try:
        run = (np.uint64(source.ctypes.data), np.int32(0), np.int64(0), np.int16(4096))
        link.submit([run]).wait(30.0)
        assert dest.digests() == [_digest(source)]
    finally:
        link.close()


@pytest.mark.parametrize(
    "regions",
    [[-1], ["4096"], [True], [4096.0], None, 4096],
    ids=["negative", "str", "bool", "float", "none", "int"],
)
def test_a_description_of_garbage_regions_is_refused_at_connect(transport, destination, regions):
    dest = destination([4096])
    source = _source(4096, seed=14)
    with pytest.raises(InvalidArgumentError, match="regions"):
        transport.connect(dict(dest.described, regions=regions), [(source.ctypes.data, 4096)])


def test_the_transport_declares_how_it_knows_completion(transport):
    """Transport.completion is one pdhal knows; require_target_completion passes it if it
    is "target", else refuses it naming it, as it does a transport that declares nothing."""
    assert transport.completion in COMPLETIONS, (
        f"{transport.name} declares {transport.completion!r}"
    )
    if transport.completion == "target":
        require_target_completion(transport)
    else:
        with pytest.raises(TransferError, match=f"transport {transport.name!r} declares"):
            require_target_completion(transport)

    class Silent(Transport):
        name = "silent"

    with pytest.raises(TransferError, match="transport 'silent' declares completion 'local'"):
        require_target_completion(Silent())


#: The load of the test below: requests of AREA bytes each, written in SUBMITS submits of
#: RUNS runs in flight together, then their marker (8 bytes) in a submit of its own.
AREA, REQUESTS, SUBMITS, RUNS = 16 << 20, 96, 4, 4


def test_a_marker_written_once_a_batch_is_done_never_overtakes_its_bytes(
    transport, watching_destination, busy_cpu
):
    """Completion at the target, under load: REQUESTS requests of AREA bytes, a CPU kept
    busy meanwhile. Each request's data goes in SUBMITS submits in flight
    together; once they are all done, a marker word goes in a submit of its own (as the
    streamer writes "landed"). The destination spins on the marker and checks every byte of
    the request's data at once: a byte not there yet means a batch was reported done before
    its bytes were in the destination's memory. (Two data areas, used in turn, so that the
    destination checks one while the next request is written to the other.)"""
    if transport.completion != "target":
        pytest.skip(f"{transport.name} declares completion {transport.completion!r}")
    dest = watching_destination(AREA, REQUESTS, bound=60.0)
    words = np.arange(AREA // 8, dtype=np.uint64)
    data, marks = np.empty(AREA // 8, np.uint64), np.zeros(2, np.uint64)
    sources = [(data.ctypes.data, data.nbytes), (marks.ctypes.data, marks.nbytes)]
    link = transport.connect(dest.described, sources)
    chunk = AREA // (SUBMITS * RUNS)
    verdicts = []
    try:
        for k in range(REQUESTS):
            slot, mark = k % 2, k + 1
            if k >= 2:  # area `slot` was request k - 2's: its check is over
                verdicts.append(dest.verdict())
            data[:] = words + np.uint64(mark << 40)
            runs = [(data.ctypes.data + at, slot, at, chunk) for at in range(0, AREA, chunk)]
            batches = [link.submit(runs[i : i + RUNS]) for i in range(0, len(runs), RUNS)]
            for batch in batches:
                batch.wait(60.0)
            marks[slot] = mark
            link.submit([(marks.ctypes.data + 8 * slot, 2, 8 * slot, 8)]).wait(60.0)
        verdicts += [dest.verdict() for _ in range(min(2, REQUESTS))]
        dest.close()
    finally:
        link.close()
    early = [v for v in verdicts if v["missing"] != 0]
    assert not early, (
        f"{len(early)} of {REQUESTS} requests' markers were read before their bytes were there "
        f"(a batch reported done before its bytes were in the destination's memory): {early[:5]}"
    )


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


def test_a_gated_submit_waits_for_its_signal_and_one_whose_signal_never_comes_fails_alone(
    transport, destination
):
    """A transport whose links gate (Transport.gates, which KVStreamer.follow needs) starts
    a gated submit's copies only at the engine's layer signal, holding up no other submit
    meanwhile; one whose signal does not come in time (or that is cancelled) fails with
    nothing written and its copies unstarted, while the submits after it land."""
    if not getattr(transport, "gates", False):
        pytest.skip(f"{transport.name!r} declares no gates: KVStreamer.follow refuses it")
    from pdhal import ops
    from pdhal._protocol import core, signals

    block = 1024
    dest = destination([4 * block])
    source = _source(4 * block, seed=7)
    layer = LayerCopies([(source.ctypes.data, block, 0, 0, block, block)])
    to = [BlockRuns([(b, b, 1)]) for b in range(4)]  # source block b to destination block b
    link = transport.connect(dest.described, [(source.ctypes.data, source.nbytes)])
    meta = ops.open_shm_and_get_meta_signal(0, 0)  # this process is the engine: step 1
    reader = ops.open_kv_signal_reader(0, 0, timeout=30)
    word = lambda n: (1 << core.LAYER_BITS) | (n + 1)  # noqa: E731 (layer n of step 1)
    landed = np.zeros(4 * block, np.uint8)
    try:
        held = link.submit_blocks(layer, to[0], Gate(reader.segment, word(0), 60.0))
        link.submit_blocks(layer, to[3]).wait(30.0)  # not behind the gate
        landed[3 * block :] = source[3 * block :]
        assert not held.done() and held.started_ns() == 0
        assert dest.digests() == [_digest(landed)]
        signalled = time.monotonic_ns()
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))
        held.wait(30.0)
        landed[:block] = source[:block]
        assert held.started_ns() >= signalled and dest.digests() == [_digest(landed)]
        late = link.submit_blocks(layer, to[1], Gate(reader.segment, word(1), 0.1))
        given_up = link.submit_blocks(layer, to[2], Gate(reader.segment, word(2), 60.0))
        given_up.cancel()
        for failed in (late, given_up):
            with pytest.raises(TransferError):
                failed.wait(30.0)
            assert failed.started_ns() == 0
        after = link.submit_blocks(layer, to[3], Gate(reader.segment, word(0), 30.0))
        after.wait(30.0)  # a gate's failure is its own submit's: signalled already, it goes
        for n in (1, 2):  # too late: nothing moves
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, n))
        link.submit_blocks(layer, to[0]).wait(30.0)  # (behind anything that might)
        assert dest.digests() == [_digest(landed)]
    finally:
        link.close()
        reader.close()
        signals.close_producer_channels()
