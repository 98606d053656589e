"""Per-query and per-chunk signals across real processes: nothing lost, duplicated,
reordered or torn."""

from __future__ import annotations

import array
import os
import subprocess
import time

import pytest

import pdhal
from pdhal import ops
from pdhal.testing.fixtures import python_child

LAYERS = 32
STEPS = 3125  # x 32 layers = 100,000 signals


def test_per_query_lockstep_delivers_every_signal_once_in_order():
    """The producer waits for an ack of each (step, layer) on a reverse channel, so the reader
    must observe all 100,000 signals individually, in order."""
    producer = python_child(f"""
        from pdhal import ops
        acks = ops.open_kv_signal_reader(1, 0, timeout=30)
        last = (0, -1)
        for step in range({STEPS}):
            meta = ops.open_shm_and_get_meta_signal(0, 0)
            for layer in range({LAYERS}):
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
                want = (meta.step, layer)
                while last < want:
                    last = acks.wait(last, timeout=30)
                assert last == want, (last, want)
    """)
    ack = ops.open_shm_and_get_meta_signal(1, 0)  # ack steps follow the producer's steps
    reader = ops.open_kv_signal_reader(0, 0, timeout=30)
    observed = []
    since = (0, -1)
    while len(observed) < STEPS * LAYERS:
        since = reader.wait(since, timeout=30)
        if since[1] == -1:
            continue  # a step started; its layers follow
        observed.append(since)
        if since[1] == 0 and since[0] > 1:
            ack = ops.open_shm_and_get_meta_signal(1, 0)
        ops.signal_layer_ready(ops.init_signal_layerwise(ack, since[1]))
    assert producer.wait(timeout=60) == 0
    reader.close()
    expected = [(s, layer) for s in range(1, STEPS + 1) for layer in range(LAYERS)]
    assert observed == expected


def test_per_query_free_running_never_tears():
    """The writer keeps layer == step % 1000 on every signal; every observation must agree,
    and progress never goes backwards."""
    producer = python_child("""
        from pdhal import ops
        for _ in range(20000):
            meta = ops.open_shm_and_get_meta_signal(0, 0)
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, meta.step % 1000))
        meta = ops.open_shm_and_get_meta_signal(0, 0, keep_pd_step_flag=True)
        import time; time.sleep(0.5)
    """)
    reader = ops.open_kv_signal_reader(0, 0, timeout=30)
    since, count = (0, -1), 0
    while since[0] < 20000 or since[1] == -1:
        now = reader.wait(since, timeout=30)
        assert now > since
        assert now[1] in (-1, now[0] % 1000), f"torn observation {now}"
        since, count = now, count + 1
    assert producer.wait(timeout=30) == 0
    reader.close()
    assert count > 1


MANY_READERS_PUBLISHES = int(os.environ.get("PDHAL_MANY_READERS_PUBLISHES", "50000"))


@pytest.mark.parametrize("cpus", ["one CPU", "every CPU"])
def test_one_writer_and_four_readers_lose_no_wake(cpus):
    """Four reader processes wait on one per-query channel while its writer publishes in
    bursts, all pinned to one CPU (so preemption lands inside waits) or spread. Each reader
    sees progress only grow and reaches the end. After each of 10 bursts the writer lets
    the readers block, publishes one probe value and publishes nothing more until every
    reader said it saw the probe. The readers' wait slice is an hour
    (PDHAL_WAIT_SLICE_MS), so nothing but the probe's wake can end their wait: a lost wake
    sleeps to the wait's 30 s deadline, and a reader fails on any wait of 5 s or more (a
    hang, not a delay: a loaded machine's are milliseconds). `make stress` runs 1,000,000
    publishes."""
    layers, bursts = 25, 10
    steps = MANY_READERS_PUBLISHES // layers // bursts * bursts
    probes = [(b + 1) * steps // bursts for b in range(bursts)]  # steps whose last layer
    affinity = sorted(os.sched_getaffinity(0))
    pin = f"os.sched_setaffinity(0, {set(affinity[:1] if cpus == 'one CPU' else affinity)})"
    writer = python_child(
        f"""
        import os, sys, time
        {pin}
        from pdhal import ops
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        print("created", flush=True)
        sys.stdin.readline()  # every reader is attached
        published = []
        for step in range(1, {steps} + 1):
            if step > 1:
                meta = ops.open_shm_and_get_meta_signal(0, 0)
            for layer in range({layers}):
                signal = ops.init_signal_layerwise(meta, layer)
                if step in {probes} and layer == {layers - 1}:
                    time.sleep(0.02)  # the readers catch up and block (likely, not needed)
                    ops.signal_layer_ready(signal)
                    print("probe", flush=True)
                    assert sys.stdin.readline() == "seen\\n"  # by every reader
                else:
                    ops.signal_layer_ready(signal)
        sys.stdin.read()  # alive until the readers are done
    """,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "created\n"
    readers = [
        python_child(
            f"""
        import os, time
        {pin}
        from pdhal import ops
        reader = ops.open_kv_signal_reader(0, 0, timeout=30)
        print("ready", flush=True)
        since, seen, probes = reader.current(), 0, {probes}
        while since != ({steps}, {layers - 1}):
            began = time.monotonic()
            now = reader.wait(since, timeout=30)  # a lost wake sleeps to the deadline
            assert time.monotonic() - began < 5, f"a wait past {{since}} slept to its deadline"
            assert since < now and now[1] < {layers}, (since, now)
            if seen < len(probes) and now >= (probes[seen], {layers - 1}):
                print("saw", seen, flush=True)
                seen += 1
            since = now
    """,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PDHAL_WAIT_SLICE_MS": "3600000"},
        )
        for _ in range(4)
    ]
    for reader in readers:
        assert reader.stdout.readline() == "ready\n"
    writer.stdin.write("go\n")
    writer.stdin.flush()
    for probe in range(bursts):
        assert writer.stdout.readline() == "probe\n"
        for reader in readers:  # "" once a reader ended: its wait timed out (a lost wake)
            assert reader.stdout.readline() == f"saw {probe}\n", f"probe {probe} never seen"
        writer.stdin.write("seen\n")
        writer.stdin.flush()
    for reader in readers:
        reader.communicate(timeout=600)
    assert [reader.returncode for reader in readers] == [0] * 4
    writer.stdin.close()
    assert writer.wait(timeout=30) == 0


def _expected_table(step: int) -> list[tuple[int, int, int]]:
    batch = 1 + step % 7
    return [
        (slot, step + slot, 1 + (step * 3 + slot) % 200)
        for slot in range(batch)
        if (step + slot) % 3 != 0 or slot == 0
    ]


PRODUCE_CHUNKS = f"""
    from pdhal import ops
    import sys
    sys.path.insert(0, {__file__.rsplit("/", 1)[0]!r})
    from test_signals import _expected_table
    for step in range(1, {STEPS} + 1):
        batch = 1 + step % 7
        table = dict((slot, (dec, enc)) for slot, dec, enc in _expected_table(step))
        encoder = [table.get(i, (0, 0))[1] for i in range(batch)]
        decoder = [table.get(i, (i, 0))[0] for i in range(batch)]
        chunk = ops.init_kv_signal_per_query(encoder, encoder, decoder, 0, {LAYERS})
        assert chunk.step == step
        for layer in range({LAYERS}):
            ops.signal_layer_ready(chunk.layer(layer))
"""


def test_per_chunk_100k_records_exactly_once_in_order():
    producer = python_child(PRODUCE_CHUNKS)
    out = array.array("i", [0] * 1538)
    for step in range(1, STEPS + 1):
        want = _expected_table(step)
        for layer in range(LAYERS):
            ops.get_output_kv_signal(out, 0, True)
            count = out[0]
            assert (count, out[1]) == (len(want), layer), (step, layer, list(out[:8]))
            got = [tuple(out[2 + 3 * i : 5 + 3 * i]) for i in range(count)]
            assert got == want, (step, layer)
    assert producer.wait(timeout=60) == 0
    with pytest.raises(pdhal.ProducerDiedError):  # nothing left, and nobody to produce it
        ops.get_output_kv_signal(out, 0, False)


def test_per_chunk_reader_attaching_late_loses_nothing(monkeypatch):
    """The producer runs ahead of a reader that has not attached: it is held at the ring's
    end instead of overwriting, and the late reader gets every step."""
    producer = python_child(PRODUCE_CHUNKS.replace(str(STEPS), "100"))
    time.sleep(1.0)  # the producer fills the ring (16 steps) and waits for a reader
    assert producer.poll() is None
    out = array.array("i", [0] * 1538)
    for step in range(1, 101):
        for layer in range(LAYERS):
            ops.get_output_kv_signal(out, 0, True, timeout=30)
            assert out[1] == layer and out[0] == len(_expected_table(step))
    assert producer.wait(timeout=60) == 0


def test_draft_model_keeps_the_step_and_continues_layers():
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    for layer in range(4):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
    draft = ops.open_shm_and_get_meta_signal(0, 0, keep_pd_step_flag=True)
    assert draft.step == meta.step
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (meta.step, 3)
        ops.signal_layer_ready(ops.init_signal_layerwise(draft, 4))  # main layers + offset
        assert reader.current() == (meta.step, 4)
        nxt = ops.open_shm_and_get_meta_signal(0, 0)
        assert reader.current() == (meta.step + 1, -1) and nxt.step == meta.step + 1


def test_late_signal_of_an_old_step_is_ignored():
    old = ops.open_shm_and_get_meta_signal(0, 0)
    new = ops.open_shm_and_get_meta_signal(0, 0)
    ops.signal_layer_ready(ops.init_signal_layerwise(new, 1))
    ops.signal_layer_ready(ops.init_signal_layerwise(old, 30))
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (new.step, 1)


def test_step_without_prefill_requests_publishes_nothing():
    chunk = ops.init_kv_signal_per_query([0, 0], [1, 1], [5, 9], 0, 4)
    ops.signal_layer_ready(chunk.layer(0))
    out = array.array("i", [0] * 1538)
    ops.get_output_kv_signal(out, 0, False)
    assert list(out[:2]) == [-1, -1]


def test_wait_times_out_with_a_clear_error():
    ops.open_shm_and_get_meta_signal(0, 0)
    with ops.open_kv_signal_reader(0, 0) as reader:
        start = time.monotonic()
        with pytest.raises(pdhal.SignalTimeoutError, match="no progress past step 1"):
            reader.wait(reader.current(), timeout=0.1)
        assert 0.1 <= time.monotonic() - start < 0.3


def test_bad_waits_are_pdhal_errors_that_say_what_was_expected():
    ops.open_shm_and_get_meta_signal(0, 0)
    with ops.open_kv_signal_reader(0, 0) as reader:
        for kwargs, expected in [
            ({"since": (1,)}, "since must be a .step, layer. pair of integers, got .1,."),
            ({"since": (1, 2**20)}, "-1 <= layer <= 1048574, got .1, 1048576."),
            ({"since": (-1, 0)}, "0 <= step < 2..44"),
            ({"timeout": float("nan")}, "timeout must be a number of seconds >= 0 or None"),
            ({"timeout": "1"}, "timeout must be a number of seconds >= 0 or None, got '1'"),
            ({"spin_us": -5}, "spin_us must be in .0, 1000001., got -5"),
            ({"spin_us": 0.5}, "spin_us must be an integer"),
        ]:
            with pytest.raises(pdhal.InvalidArgumentError, match=expected):
                reader.wait(**{"since": (0, -1), **kwargs})
        assert reader.wait((0, -1), timeout=float("inf")) == (1, -1)  # inf: no deadline


def test_a_spin_runs_before_the_sleep_and_ends_at_the_deadline():
    """A wait spins (it burns CPU) for spin_us, then sleeps (it does not); a spin longer than
    the timeout does not stretch it. Both waits."""
    ops.open_shm_and_get_meta_signal(0, 0)
    ops.init_kv_signal_per_query([8], [8], [0], 0, 4)  # a step whose layers never come
    with ops.open_kv_signal_reader(0, 0) as reader:
        start = time.monotonic()
        with pytest.raises(pdhal.SignalTimeoutError):
            reader.wait(reader.current(), timeout=0.05, spin_us=1_000_000)
        assert time.monotonic() - start < 0.5
    with ops.open_kv_chunk_reader(0, 0) as reader:
        out = array.array("i", [0] * 8)
        start = time.monotonic()
        assert reader.next(out, timeout=0.05, spin_us=1_000_000) is None
        assert time.monotonic() - start < 0.5 and list(out[:2]) == [-1, -1]
        # the waiting thread's own CPU (not the process's); a 200 ms spin gets at least a
        # tenth of a core on a loaded machine, a sleep next to none
        for spin_us, cpu in ((0, lambda s: s < 0.005), (200_000, lambda s: s >= 0.02)):
            start = time.thread_time()
            assert reader.next(out, timeout=0.3, spin_us=spin_us) is None
            assert cpu(time.thread_time() - start), (spin_us, time.thread_time() - start)


def test_spinning_readers_get_every_record_once_in_order():
    steps, layers = 300, 8
    producer = python_child(f"""
        import time
        from pdhal import ops
        for step in range(1, {steps} + 1):
            meta = ops.open_shm_and_get_meta_signal(0, 0)
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, {layers})
            for layer in range({layers}):
                if layer % 3 == 0:
                    time.sleep(0.0002)  # some records come within the spin, some after it
                ops.signal_layer_ready(chunk.layer(layer))
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
    """)
    query = ops.open_kv_signal_reader(0, 0, timeout=30)
    out = array.array("i", [0] * 8)
    for step in range(1, steps + 1):
        for layer in range(layers):
            ops.get_output_kv_signal(out, 0, True, timeout=30, spin_us=100)
            assert (out[0], out[1], out[4]) == (1, layer, step), (step, layer, list(out[:5]))
    assert query.wait((steps, layers - 2), timeout=30, spin_us=100) == (steps, layers - 1)
    query.close()
    assert producer.wait(timeout=30) == 0


def test_ops_are_the_backends_own_functions():
    from pdhal._backends import registry as _registry
    from pdhal._backends.cpu import backend as _cpu
    from pdhal._protocol import signals as _signals

    assert ops.signal_layer_ready is _cpu.signal_layer_ready
    assert ops.host_free is _registry.selection().candidate.backend.ops()["host_free"]
    assert ops.init_signal_layerwise is _signals.init_signal_layerwise
    assert ops.cuda_host_alloc is ops.host_alloc


def test_backpressure_timeout_is_read_from_the_environment(monkeypatch):
    """No reader: the ring's 16 steps fill, then the 17th waits PDHAL_BACKPRESSURE_TIMEOUT."""
    monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", "0.2")
    for _ in range(16):
        ops.init_kv_signal_per_query([1], [1], [0], 0, 1)
    start = time.monotonic()
    with pytest.raises(pdhal.BackPressureTimeoutError, match="no cache messager is attached"):
        ops.init_kv_signal_per_query([1], [1], [0], 0, 1)
    assert 0.2 <= time.monotonic() - start < 1.0
    for bad in ("abc", "0", "-1", "nan", ""):
        monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", bad)
        with pytest.raises(pdhal.InvalidArgumentError, match="PDHAL_BACKPRESSURE_TIMEOUT must"):
            ops.init_kv_signal_per_query([1], [1], [0], 0, 1)


def test_each_device_of_a_rank_has_its_own_channel():
    a = ops.open_shm_and_get_meta_signal(0, 0)
    b = ops.open_shm_and_get_meta_signal(0, 1)
    ops.signal_layer_ready(ops.init_signal_layerwise(b, 5))
    with ops.open_kv_signal_reader(0, 0) as r0, ops.open_kv_signal_reader(0, 1) as r1:
        assert (r0.current(), r1.current()) == ((a.step, -1), (b.step, 5))


def test_an_empty_step_on_one_channel_keeps_another_channels_current_step():
    """A C op's "next layer of the current per-chunk step" belongs to the last step started;
    a step with no prefill request on another device's channel must not end it."""
    from pdhal._protocol.core import lib

    ops.init_kv_signal_per_query([3], [3], [0], 0, 2, device_id=0)
    ops.init_kv_signal_per_query([0], [1], [4], 0, 2, device_id=1)  # decode only: nothing
    for _ in range(2):
        lib.pdhal_store_run(lib.pdhal_next_chunk_layer_store())
    out = array.array("i", [0] * 1538)
    seen = []
    for _ in range(2):
        ops.get_output_kv_signal(out, 0, False, device_id=0)
        seen.append((out[1], out[4]))
    assert seen == [(0, 3), (1, 3)]
    ops.init_kv_signal_per_query([0], [1], [4], 0, 2, device_id=0)  # its own empty step ends it
    assert lib.pdhal_next_chunk_layer_store() == pdhal._protocol.core.ffi.NULL
