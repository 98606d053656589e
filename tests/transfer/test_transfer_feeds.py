"""The streamer driven by real layer signals: a model-worker process writes each layer's
blocks into its (shared) caches and then signals the layer, per chunk or per query; this
process is the cache messager (its reader, a feed, the streamer); a decode process checks
every byte. A block sent before its layer wrote it would land as zeros and fail the check.

Two requests in chunked prefill over two steps: "a" (10 tokens: 6, then 4) in source
blocks 0, 1, 2 and "b" (6 tokens, one chunk) in 4, 5; blocks of 4 tokens. A block the
worker has only partly written holds a marker, so one sent before it is whole (a's block 1
after step 1) lands wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import pdhal
from pdhal import ops, transfer
from pdhal.testing.transfer_peers import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    BLOCKS,
    CACHES,
    LAYERS,
    Decode,
    expected,
    landed_blocks,
    outcomes_until,
)

SOURCE = {"a": [0, 1, 2], "b": [4, 5]}
DEST = {"a": [7, 3, 4], "b": [0, 1]}
PROMPT = {"a": 10, "b": 6}

WORKER = f"""
import sys
import time
from pdhal import ops
from pdhal.testing.transfer_peers import pattern
L, C, B, BB, BT = {LAYERS}, {CACHES}, {BLOCKS}, {BLOCK_BYTES}, {BLOCK_TOKENS}
mode = sys.argv[1]
pause = tuple(map(int, sys.argv[2].split(","))) if len(sys.argv) > 2 else None  # step, layer
buffers = [[ops.host_alloc(B * BB) for _ in range(C)] for _ in range(L)]
caches = [[b.as_numpy("uint8", (B, BB)) for b in row] for row in buffers]
for layer, row in enumerate(buffers):
    for cache, buf in enumerate(row):
        caches[layer][cache][:] = 0
        ops.set_data_ipc(buf, f"prefill.l{{layer}}c{{cache}}")
# (slot, first block, tokens before, tokens this step, prompt) of each step's prefill chunks
STEPS = [[(0, 0, 0, 6, 10), (1, 4, 0, 6, 6)], [(0, 0, 6, 4, 10)]]
PARTIAL = 0xEE  # a block whose tokens are not all written yet
print("ready", flush=True)
sys.stdin.readline()
for number, chunks in enumerate(STEPS, 1):
    encoder, this_time, decoder = [0, 0], [1, 1], [0, 0]
    for slot, _, before, length, _ in chunks:
        encoder[slot], this_time[slot], decoder[slot] = length, length, before
    if mode == "per_chunk":
        step = ops.init_kv_signal_per_query(encoder, this_time, decoder, 0, L)
        signal_of = step.layer
    else:
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        signal_of = lambda layer: ops.init_signal_layerwise(meta, layer)
    for layer in range(L):
        for slot, first, before, length, prompt in chunks:  # the layer writes, then signals
            now = before + length
            for block in range(before // BT, -(-now // BT)):
                whole = (block + 1) * BT <= now or now == prompt
                for cache in range(C):
                    value = pattern(layer, cache, first + block) if whole else PARTIAL
                    caches[layer][cache][first + block] = value
        ops.signal_layer_ready(signal_of(layer))
        if (number, layer) == pause:  # the test looks at what its signals so far did
            print("paused", flush=True)
            sys.stdin.readline()
    print("step done", flush=True)
    sys.stdin.readline()  # the messager has this step (a per-query reader must not fall behind)
print("done", flush=True)
sys.stdin.readline()
"""


class Worker:
    def __init__(self, mode: str, pause: tuple[int, int] | None = None):
        """`pause` (step, layer): it stops after signalling that layer, says "paused" and
        goes on at go()."""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, mode, *([",".join(map(str, pause))] if pause else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.expect("ready")

    def expect(self, line: str) -> None:
        got = self.proc.stdout.readline().strip()
        assert got == line, f"worker said {got!r} ({self.proc.poll()}), not {line!r}"

    def go(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """Its input ends: every pause it has left returns at once, so it runs to its end
        (a test failing halfway waits for nothing)."""
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0
        self.proc.stdout.close()


def prefill_caches() -> list[list[np.ndarray]]:
    return [
        [
            ops.share_external_data("uint8", f"prefill.l{layer}c{cache}", [BLOCKS, BLOCK_BYTES])
            for cache in range(CACHES)
        ]
        for layer in range(LAYERS)
    ]


@pytest.mark.parametrize("mode", ["per_chunk", "per_query"])
def test_blocks_go_as_their_layer_s_signal_makes_them_ready(mode):
    decode, worker = Decode(), Worker(mode)
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS)
    try:
        dest = streamer.connect(decode.described)
        for request in SOURCE:
            streamer.add_request(request, SOURCE[request], PROMPT[request])
            streamer.set_destination(request, dest, DEST[request], decode.expect(request))
        steps = [{0: "a", 1: "b"}, {0: "a"}]
        tables = [[("a", 6), ("b", 6)], [("a", 10)]]
        if mode == "per_chunk":
            feed = transfer.PerChunkFeed(streamer)
            record = np.zeros(pdhal.RECORD_WORDS, np.int32)
            worker.go()  # its first step creates the channel the reader opens
            with ops.open_kv_chunk_reader(0, 0, timeout=30) as reader:
                for index, holders in enumerate(steps):
                    feed.slots(index + 1, holders)  # per-chunk steps count from 1
                    for _ in range(LAYERS):
                        feed.record(reader.next(record, wait=True, timeout=30), record)
                    worker.expect("step done")
                    worker.go()
        else:
            feed = transfer.PerQueryFeed(streamer)
            worker.go()
            with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
                seen = (0, -1)
                for index, table in enumerate(tables):
                    feed.step(index + 1, table)
                    while seen < (index + 1, LAYERS - 1):
                        seen = reader.wait(seen, timeout=30)
                        feed.progress(seen)
                    worker.expect("step done")
                    worker.go()
        worker.expect("done")
        ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
        assert all(o.landed for o in ended.values()), ended
        for request in SOURCE:
            assert_landed_whole(decode, request)
        # one submit per layer and step: a's first block with b's two, then a's last two
        per_layer = [r.layer for r in streamer.metrics.layers()]
        assert sorted(per_layer) == sorted(list(range(LAYERS)) * 2)
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_a_dead_prefill_worker_fails_its_requests_on_both_sides(namespace):
    """SIGKILL the model worker after step 1: the messager's reader says so
    (ProducerDiedError), abort() ends what was in flight on both sides with that reason,
    and the worker's leftovers are its own."""
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS)
    try:
        dest = streamer.connect(decode.described)
        for request in SOURCE:
            streamer.add_request(request, SOURCE[request], PROMPT[request])
            streamer.set_destination(request, dest, DEST[request], decode.expect(request))
        feed = transfer.PerQueryFeed(streamer)
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            feed.step(1, [("a", 6), ("b", 6)])
            seen = (0, -1)
            while seen < (1, LAYERS - 1):
                seen = reader.wait(seen, timeout=30)
                feed.progress(seen)
            worker.expect("step done")
            worker.proc.kill()
            worker.proc.wait(timeout=30)
            with pytest.raises(pdhal.ProducerDiedError) as died:
                reader.wait(seen, timeout=30)
        streamer.abort(f"the prefill worker died: {died.value}")
        ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
        assert ended["b"].landed, "b was whole after step 1"
        assert not ended["a"].landed and "the prefill worker died" in ended["a"].reason
        landed, reason, _, _ = decode.wait("a")
        assert not landed and "the prefill worker died" in reason
        assert decode.wait("b")[0] and streamer.pending() == 0
    finally:
        streamer.close()
        worker.proc.stdin.close()
        worker.proc.stdout.close()
        decode.close()
    removed, left = pdhal.cleanup(namespace)
    names = sorted(os.path.basename(p).split(".", 3)[3] for p in removed)
    caches = LAYERS * CACHES
    assert left == [] and len(names) == 2 * caches + 1, names  # its caches, their records
    assert all(  # ... and its channel: nothing else
        n.startswith((f"buf.host.{worker.proc.pid}.", "buf.prefill.", "query.r0.d0")) for n in names
    ), names


# ---- followed: the link waits for each layer's signal itself (KVStreamer.follow) ----------


#: What a followed test writes into source blocks whose step has not run: a decode block
#: holding it got a copy that was never to be made.
STALE = 0x77


def _make_stale(caches, blocks: list[int]) -> None:
    for row in caches:
        for cache in row:
            cache[blocks] = STALE


def _stale_in(decode, blocks: list[int]) -> bool:
    """Whether any byte of `blocks` in any layer and cache of `decode` is STALE."""
    return any(
        byte == STALE
        for layer in range(LAYERS)
        for cache in range(CACHES)
        for block in blocks
        for byte in decode.block(layer, cache, block)
    )


def assert_landed_whole(decode, request: str) -> None:
    """`request` landed in `decode`, every block of it the bytes its source block holds."""
    landed, reason, dump, uniform = decode.wait(request)
    assert landed and uniform, reason
    for src, dst in zip(SOURCE[request], DEST[request]):
        assert landed_blocks(dump, dst) == expected(src), f"{request}: {src} -> {dst}"


def _streaming(streamer, decode, requests=SOURCE, **expect):
    dest = streamer.connect(decode.described)
    for request in requests:
        streamer.add_request(request, SOURCE[request], PROMPT[request])
        streamer.set_destination(request, dest, DEST[request], decode.expect(request, **expect))
    return dest


@pytest.mark.parametrize("layerwise", [False, True])
def test_followed_steps_land_every_byte_once_their_layers_are_signalled(layerwise):
    """One follow() per step and no call per layer: each layer's copies wait on the shm
    link's copier for that layer's signal. Step 2 is followed before the worker computes
    it, so a copy that did not wait would land the zeros its blocks held (a's last block
    holds the partial-block marker after step 1, which the first step must not send).
    `layerwise`: both decode sides read their requests layer by layer (vLLM's sync load),
    each hearing a layer only once it landed: a hears none before step 2's signals."""
    decode, worker = Decode(), Worker("per_query", pause=(2, 0) if layerwise else None)
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS)
    try:
        _streaming(streamer, decode, layerwise=layerwise)
        worker.go()  # its first step creates the channel
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            streamer.follow(reader, 1, [("a", 6), ("b", 6)])
            worker.expect("step done")
            b = outcomes_until(streamer, 1)
            assert [(o.request_id, o.landed) for o in b] == [("b", True)], b
            streamer.follow(reader, 2, [("a", 10)])  # before the worker computes step 2
            assert streamer.poll(timeout=0.2) == []  # a waits for step 2's signals
            if layerwise:  # no layer of a whole before its last block came; then layer 0
                assert decode.layers("a")[0] == 0
                worker.go()
                worker.expect("paused")
                assert decode.layers_until("a", 1)[0] == 1
                time.sleep(0.1)  # layer 1 not signalled: nothing more is told
                assert decode.layers("a")[0] == 1
            worker.go()
            worker.expect("step done")
            a = outcomes_until(streamer, 1)
            assert [(o.request_id, o.landed) for o in a] == [("a", True)], a
            worker.go()
        worker.expect("done")
        for request in SOURCE:
            assert_landed_whole(decode, request)
        records = streamer.metrics.layers()
        assert sorted((r.step, r.layer) for r in records) == sorted(
            (step, layer) for step in (1, 2) for layer in range(LAYERS)
        )
        # submitted when the link saw the signal: never before it was published
        assert all(r.signal_ns == r.submit_ns <= r.end_ns for r in records)
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_blocks_given_after_their_step_was_followed_wait_for_its_signals():
    """a's prompt comes chunk by chunk and so do its source blocks: block 0 with step 1,
    blocks 1 and 2 given (add_blocks) once step 2 was followed, before the worker computes
    it. They go behind step 2's gates, not at once: a copy that did not wait would land
    the partial-block marker and zeros the worker wrote before step 2."""
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS)
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("a", SOURCE["a"][:1], PROMPT["a"])
        streamer.set_destination("a", dest, DEST["a"], decode.expect("a"))
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            streamer.follow(reader, 1, [("a", 6)])
            worker.expect("step done")
            streamer.follow(reader, 2, [("a", 10)])
            streamer.add_blocks("a", SOURCE["a"][1:])
            assert streamer.poll(timeout=0.2) == []  # its last blocks wait for step 2
            worker.go()
            worker.expect("step done")
            [a] = outcomes_until(streamer, 1)
            assert a.landed, a.reason
            worker.go()
        worker.expect("done")
        assert_landed_whole(decode, "a")
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_a_followed_layer_never_signalled_fails_its_request_alone_and_nothing_of_it_copies():
    """b is followed for a step the worker has not computed: the link's gate times out after
    stall_timeout, b fails naming the layer, and its decode side reads why at once (the
    link is fine: not its deadline). When the signals come after all, none of b's copies
    runs (its source blocks hold a stale marker the decode blocks must never see). a, sent
    layer by layer to the same decode side behind b's gates, lands."""
    decode, worker = Decode(), Worker("per_query")
    caches = prefill_caches()
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(caches), BLOCK_TOKENS, stall_timeout=0.5
    )
    try:
        _streaming(streamer, decode)
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")  # step 1 ran, unsent
            _make_stale(caches, SOURCE["b"])  # as if step 2 were to write them
            streamer.follow(reader, 2, [("b", 6)])
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [("a", 6)])
            [b] = outcomes_until(streamer, 1)
            assert not b.landed and "layer 0 of step 2 was not signalled" in b.reason, b
            landed, reason, _, _ = decode.wait("b")
            assert not landed and "layer 0 of step 2 was not signalled" in reason
            worker.go()  # the step's signals come after all
            worker.expect("step done")
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [("a", 10)])
            [a] = outcomes_until(streamer, 1)
            assert a.landed, a.reason
            worker.go()
        worker.expect("done")
        assert_landed_whole(decode, "a")
        assert not _stale_in(decode, DEST["b"])
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_a_request_sent_layer_by_layer_lands_while_a_followed_step_waits_for_its_signals():
    """a is followed for step 2 before the worker computes it; b, whole after step 1, is
    sent layer by layer to the same decode side meanwhile and lands without waiting for
    a's signals (stall_timeout is a minute: b waiting behind them fails the test's 10-s
    bound, where it lands in milliseconds). Then step 2 runs and a lands too."""
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS, stall_timeout=60.0
    )
    try:
        _streaming(streamer, decode)
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")
            streamer.follow(reader, 2, [("a", 10)])
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [("b", 6)])
            [b] = outcomes_until(streamer, 1, bound=10)
            assert b.request_id == "b" and b.landed, b
            dumps = {"b": decode.wait("b")}
            worker.go()
            worker.expect("step done")
            [a] = outcomes_until(streamer, 1)
            assert a.landed, a.reason
            worker.go()
        worker.expect("done")
        dumps["a"] = decode.wait("a")
        for request, (landed, reason, dump, uniform) in dumps.items():
            assert landed and uniform, reason
            for src, dst in zip(SOURCE[request], DEST[request]):
                assert landed_blocks(dump, dst) == expected(src), f"{request}: {src} -> {dst}"
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_abort_ends_a_followed_step_whose_worker_died_at_once_on_both_sides(namespace, faulty):
    """The worker dies with a's second step followed: the reader says so, and abort() ends
    a with that reason on both sides at once, its gates given up (stall_timeout is a
    minute: waiting for it fails the test's bound). b, whose only step was signalled whole,
    lands though none of its layers had settled when abort() came (the link holds them:
    a loaded machine's copier thread that has not run yet)."""
    held = faulty("held")
    held.release.clear()
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(prefill_caches()),
        BLOCK_TOKENS,
        stall_timeout=60.0,
        transport_name="faulty",
    )
    try:
        _streaming(streamer, decode)
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            streamer.follow(reader, 1, [("a", 6), ("b", 6)])
            worker.expect("step done")
            streamer.follow(reader, 2, [("a", 10)])
            worker.proc.kill()
            worker.proc.wait(timeout=30)
            with pytest.raises(pdhal.ProducerDiedError) as died:
                reader.wait((1, LAYERS - 1), timeout=30)
        assert streamer.metrics.layers() == [], "nothing settles while the link holds it"
        streamer.abort(f"the prefill worker died: {died.value}")
        held.release.set()
        ended = {o.request_id: o for o in outcomes_until(streamer, 2, bound=30)}
        assert ended["b"].landed, "b was whole after step 1"
        assert not ended["a"].landed and "the prefill worker died" in ended["a"].reason
        landed, reason, _, _ = decode.wait("a")
        assert not landed and "the prefill worker died" in reason
    finally:
        held.release.set()
        streamer.close()
        worker.proc.stdin.close()
        worker.proc.stdout.close()
        decode.close()
        pdhal.cleanup(namespace)  # the dead worker's leftovers


def test_a_restarted_worker_s_channel_counts_its_followed_steps_anew(namespace):
    """The steps follow() took are kept per channel: after the worker died and another
    made the channel anew, its step 1 may be followed (the late claims of PrefillService
    follow at the channel's last step: an attack had them wait for the dead one's)."""
    dead, worker = Worker("per_query"), None
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS)
    try:
        dead.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            dead.expect("step done")
            streamer.follow(reader, 1, [])
            dead.go()
            dead.expect("step done")
            streamer.follow(reader, 2, [])
            assert streamer.last_followed(reader) == 2
        dead.proc.kill()
        dead.proc.wait(timeout=30)
        worker = Worker("per_query")
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")
            assert streamer.last_followed(reader) == 0
            streamer.follow(reader, 1, [])  # not "after step 2"
            assert streamer.last_followed(reader) == 1
            worker.go()
            worker.expect("step done")
            worker.go()
        worker.expect("done")
    finally:
        streamer.close()
        for proc in (dead, worker):
            if proc is not None and proc.proc.poll() is None:
                proc.close()
        dead.proc.stdin.close()
        dead.proc.stdout.close()
        pdhal.cleanup(namespace)  # the dead worker's leftovers


def test_a_request_sharing_a_failed_request_s_followed_layers_still_lands():
    """a and b are followed for step 2 in the same sends; a fails before the signals: the
    layers b needs too are not given up, and b lands once the step runs."""
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS, stall_timeout=60.0
    )
    try:
        _streaming(streamer, decode)
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")
            streamer.follow(reader, 2, [("a", 10), ("b", 6)])
            streamer.fail("a", "the engine gave up on a")
            assert streamer.poll(timeout=0.3) == []  # a's share of b's sends: not given up
            worker.go()
            worker.expect("step done")
            ended = {o.request_id: o for o in outcomes_until(streamer, 2)}
            assert not ended["a"].landed and "gave up" in ended["a"].reason
            assert ended["b"].landed, ended["b"].reason
            worker.go()
        worker.expect("done")
        assert_landed_whole(decode, "b")
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_a_followed_layer_whose_copies_started_is_not_landed_before_they_end(faulty):
    """b's step was signalled before follow(): its gates open at once and its copies start,
    but the link holds their batches (faulty "held-open"): nothing of b is reported, nor a
    layer recorded, until they end."""
    held = faulty("held-open")
    held.release.clear()
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(prefill_caches()),
        BLOCK_TOKENS,
        stall_timeout=60.0,
        transport_name="faulty",
    )
    try:
        _streaming(streamer, decode, requests=["b"])
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")
            streamer.follow(reader, 1, [("b", 6)])  # (returns once the gates opened)
            assert streamer.poll(timeout=0.5) == []
            assert streamer.metrics.layers() == []
            held.release.set()
            [b] = outcomes_until(streamer, 1)
            assert b.landed, b.reason
            worker.go()
            worker.expect("step done")
            worker.go()
        worker.expect("done")
    finally:
        held.release.set()
        streamer.close()
        worker.close()
        decode.close()


def test_a_followed_layer_may_take_all_of_stall_timeout_to_be_signalled():
    """stall_timeout 3 s: step 2's first signal comes 1.5 s after follow() (a slow step):
    a lands. Each layer has the whole bound, not a share of it."""
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS, stall_timeout=3.0
    )
    try:
        _streaming(streamer, decode, requests=["a"])
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")
            streamer.follow(reader, 2, [("a", 10)])
            time.sleep(1.5)
            worker.go()
            worker.expect("step done")
            [a] = outcomes_until(streamer, 1)
            assert a.landed, a.reason
            worker.go()
        worker.expect("done")
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_a_followed_request_past_its_decode_side_s_deadline_is_given_up_before_its_signals():
    """b's decode side gives it up after 1 s, its followed step not computed: the streamer
    ends it then (not at stall_timeout, a minute), its gates given up, and when the signals
    come after all nothing of it is written (a stale marker its decode blocks never see)."""
    decode, worker = Decode(), Worker("per_query")
    caches = prefill_caches()
    streamer = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(caches), BLOCK_TOKENS, stall_timeout=60.0
    )
    try:
        _streaming(streamer, decode, requests=["b"], timeout=1.0)
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            worker.expect("step done")
            _make_stale(caches, SOURCE["b"])
            streamer.follow(reader, 2, [("b", 6)])
            [b] = outcomes_until(streamer, 1, bound=30)
            assert not b.landed and "deadline" in b.reason, b
            worker.go()
            worker.expect("step done")
            worker.go()
        worker.expect("done")
        landed, _, free = decode.outcome("b")  # (its own deadline, or the prefill side's word)
        assert not landed and (free or decode.freed()[0] == ["b"])  # the word came: b is free
        assert not _stale_in(decode, DEST["b"])
    finally:
        streamer.close()
        worker.close()
        decode.close()


def test_follow_refuses_what_it_cannot_send_before_anything_goes(faulty):
    """Each refusal names what was wrong, and nothing of the call went: the same request is
    then sent layer by layer."""
    decode, worker = Decode(), Worker("per_query")
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS)
    other = transfer.KVStreamer(
        transfer.CacheLayout.from_caches(prefill_caches()), BLOCK_TOKENS, transport_name="faulty"
    )
    faulty("")
    try:
        dest = streamer.connect(decode.described)
        streamer.add_request("b", SOURCE["b"], PROMPT["b"])
        streamer.add_request("a", SOURCE["a"], PROMPT["a"])
        worker.go()
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            with pytest.raises(pdhal.InvalidArgumentError, match="has no decode side yet"):
                streamer.follow(reader, 1, [("b", 6), ("a", 6)])
            refused = {
                "must be the per-query channel's ProgressReader": lambda: streamer.follow(
                    "reader", 1, [("b", 6)]
                ),
                "step must be": lambda: streamer.follow(reader, 0, [("b", 6)]),
                "ready must be": lambda: streamer.follow(reader, 1, "b"),
                "Transport.gates": lambda: other.follow(reader, 1, []),
            }
            streamer.set_destination("b", dest, DEST["b"], decode.expect("b"))
            streamer.set_destination("a", dest, DEST["a"], decode.expect("a"))
            for why, call in refused.items():
                with pytest.raises(pdhal.InvalidArgumentError, match=why):
                    call()
            assert streamer.metrics.layers() == []
            worker.expect("step done")
            for layer in range(LAYERS):  # b was not sent by any refused call: now it is
                streamer.layer_ready(layer, [("b", 6)])
            [b] = outcomes_until(streamer, 1)
            assert b.landed, b.reason
            closed = ops.open_kv_signal_reader(0, 0, timeout=30)
            closed.close()
            with pytest.raises(pdhal.ClosedHandleError):
                streamer.follow(closed, 2, [("a", 10)])
            streamer.follow(reader, 3, [])  # a step followed: none before it may be now
            with pytest.raises(pdhal.InvalidArgumentError, match="is followed after step 3"):
                streamer.follow(reader, 2, [("a", 10)])
            streamer.abort("done")
            worker.go()
            worker.expect("step done")
            worker.go()
        worker.expect("done")
    finally:
        streamer.close()
        other.close()
        worker.close()
        decode.close()
