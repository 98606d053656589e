"""The thread contract (docs/api.md): every op is safe from several threads of one process,
except reading one per-chunk channel, which one thread at a time may do: a second thread
inside a read is refused with ChannelBusyError, never given a duplicate or a lost record."""

from __future__ import annotations

import array
import threading
import time

import numpy as np
import pytest

import pdhal
from pdhal import ops
from pdhal.testing.fixtures import python_child

THREADS = 8


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"


def test_producer_threads_each_get_their_own_step_and_no_table_is_lost():
    """Four threads publish per-chunk steps at once: every step number is handed out once,
    and the reader gets every table, each with its own layers."""
    steps_per_thread, layers = 200, 2
    reader = python_child(
        f"""
        import array
        from pdhal import ops
        out = array.array("i", [0] * 1538)
        seen = []
        for _ in range({4 * steps_per_thread * layers}):
            ops.get_output_kv_signal(out, 0, True, timeout=60)
            seen.append((out[1], out[4]))  # (layer, tokens: which thread and step)
        import json; print(json.dumps(seen))
    """,
        stdout=-1,
        text=True,
    )
    steps: list[int] = []
    errors: list[BaseException] = []

    def produce(thread: int) -> None:
        try:
            for i in range(steps_per_thread):
                tokens = thread * 100000 + i + 1
                chunk = ops.init_kv_signal_per_query([tokens], [tokens], [0], 0, layers)
                steps.append(chunk.step)
                for layer in range(layers):
                    ops.signal_layer_ready(chunk.layer(layer))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run([threading.Thread(target=produce, args=(t,)) for t in range(4)])
    assert not errors, errors
    assert sorted(steps) == list(range(1, 4 * steps_per_thread + 1))
    import json

    seen = json.loads(reader.communicate(timeout=120)[0])
    assert reader.returncode == 0
    for i in range(0, len(seen), layers):  # each step's layers in order, nothing else between
        assert [layer for layer, _ in seen[i : i + layers]] == list(range(layers))
        assert len({tokens for _, tokens in seen[i : i + layers]}) == 1
    tokens = sorted(t for layer, t in seen if layer == 0)
    assert tokens == sorted(t * 100000 + i + 1 for t in range(4) for i in range(steps_per_thread))


def test_reader_threads_never_get_a_record_twice():
    """Eight threads call get_output_kv_signal on one channel: each record goes to exactly
    one of them; a thread that overlaps another is told so (ChannelBusyError) and retries."""
    steps, layers = 100, 4
    producer = python_child(
        f"""
        from pdhal import ops
        for step in range(1, {steps} + 1):
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, {layers})
            for layer in range({layers}):
                ops.signal_layer_ready(chunk.layer(layer))
        import sys; sys.stdin.read()
    """,
        stdin=-1,
    )
    got: list[tuple[int, int]] = []
    busy = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def read() -> None:
        out = np.zeros(1538, np.int32)
        try:
            while True:
                with lock:
                    if len(got) >= steps * layers:
                        return
                try:
                    ops.get_output_kv_signal(out, 0, True, timeout=0.05)
                except pdhal.ChannelBusyError:
                    with lock:
                        busy[0] += 1
                    continue
                except pdhal.SegmentError:
                    continue  # the producer's channel is not there yet
                if out[0] != -1:
                    with lock:
                        got.append((int(out[4]), int(out[1])))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run([threading.Thread(target=read) for _ in range(THREADS)])
    producer.stdin.close()
    assert producer.wait(timeout=30) == 0
    assert not errors, errors
    assert sorted(got) == [(s, layer) for s in range(1, steps + 1) for layer in range(layers)]
    assert busy[0] > 0, "the threads never overlapped: the test proved nothing"


def test_racing_first_calls_attach_one_reader(monkeypatch):
    """The first get_output_kv_signal of several threads at once: one reader is attached,
    none of them fails for the others' attaching. Attaching is slowed on purpose, so every
    thread arrives while the first is still attaching."""
    from pdhal._protocol import signals as _signals

    class SlowToAttach(_signals.ChunkReader):
        def __init__(self, *args, **kwargs):
            time.sleep(0.05)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_signals, "ChunkReader", SlowToAttach)
    chunk = ops.init_kv_signal_per_query([5], [5], [0], 0, 1)
    ops.signal_layer_ready(chunk.layer(0))
    barrier = threading.Barrier(THREADS)
    outcomes: list[object] = []

    def first_call() -> None:
        out = array.array("i", [0] * 1538)
        barrier.wait()
        try:
            ops.get_output_kv_signal(out, 0, False)
            outcomes.append(tuple(out[:2]))
        except pdhal.ChannelBusyError as e:  # overlapping reads, not attaching, may collide
            outcomes.append("busy" if "one thread at a time" in str(e) else str(e))

    _run([threading.Thread(target=first_call) for _ in range(THREADS)])
    assert len(outcomes) == THREADS, outcomes
    assert outcomes.count((1, 0)) == 1, outcomes
    assert set(outcomes) <= {(1, 0), (-1, -1), "busy"}


def test_per_query_steps_from_threads_are_distinct():
    steps: list[int] = []

    def start_steps() -> None:
        for _ in range(500):
            steps.append(ops.open_shm_and_get_meta_signal(0, 0).step)

    _run([threading.Thread(target=start_steps) for _ in range(4)])
    assert sorted(steps) == list(range(1, 2001))


def test_a_sender_shared_by_threads_delivers_every_signal_and_closes_once():
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    sender = ops.create_kv_signal_sender()

    def post(thread: int) -> None:
        for layer in range(thread, 4000, 4):
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), None, sender)

    _run([threading.Thread(target=post, args=(t,)) for t in range(4)])
    closers = [
        threading.Thread(target=ops.destroy_kv_signal_sender, args=(sender,)) for _ in range(4)
    ]
    _run(closers)
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (meta.step, 3999)
    with pytest.raises(pdhal.ClosedHandleError):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), None, sender)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("xpu", marks=pytest.mark.simulated)])
def test_host_free_from_threads_frees_once(backend, monkeypatch):
    """On a runtime a second free of one pointer is an error (or worse): four threads
    freeing one buffer must free it once."""
    if backend == "xpu":
        from simulators import SimRuntime

        monkeypatch.setenv("PDHAL_XPURT", SimRuntime("xpu", "libxpurt.so").path)
        monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
        from pdhal._backends import registry as _registry

        _registry.reset()
    errors: list[BaseException] = []

    def free(buf) -> None:
        try:
            ops.host_free(buf)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    released = []  # one entry per release of a buffer's memory
    probe = ops.host_alloc(1)
    cls, original = type(probe), type(probe)._release
    ops.host_free(probe)

    def slow_release(self, queued_on):  # the other threads arrive while it frees
        released.append(self.address)
        time.sleep(0.02)
        original(self, queued_on)

    monkeypatch.setattr(cls, "_release", slow_release)
    for _ in range(20):
        buf = ops.host_alloc(1 << 16)
        barrier = threading.Barrier(4)
        _run([threading.Thread(target=lambda: (barrier.wait(), free(buf))) for _ in range(4)])
        assert buf.closed
    assert not errors, errors
    assert len(released) == 20, f"{len(released)} releases of 20 buffers"


def test_closing_a_reader_while_another_thread_waits_on_it_is_safe():
    """The wait goes on over the mapping until it ends; the handle is released after it."""
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    reader = ops.open_kv_signal_reader(0, 0)
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(reader.wait((1, -1), timeout=5)))
    waiter.start()
    reader.close()
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))
    waiter.join(timeout=10)
    assert result == [(1, 0)]
    with pytest.raises(pdhal.ClosedHandleError):
        reader.current()


def test_closing_a_chunk_reader_while_another_thread_reads_it_is_safe():
    """The read in progress ends on the mapping (with its record, or none); the reader's
    later calls are refused, and a new reader gets the undelivered records."""
    chunk = ops.init_kv_signal_per_query([8], [8], [0], 0, 2)
    reader = ops.open_kv_chunk_reader(0, 0)
    got: list[object] = []

    def read() -> None:
        out = array.array("i", [0] * 1538)
        try:
            got.append(reader.next(out, timeout=5))
        except BaseException as e:  # noqa: BLE001 - checked below
            got.append(e)

    waiter = threading.Thread(target=read)
    waiter.start()
    time.sleep(0.05)  # (not needed for correctness) most runs find the reader asleep
    reader.close()
    ops.signal_layer_ready(chunk.layer(0))
    waiter.join(timeout=10)
    assert got in ([chunk.step], [None]), got
    with pytest.raises(pdhal.ClosedHandleError):
        reader.next(array.array("i", [0] * 1538), wait=False)


def test_kernel_form_posts_racing_a_channel_close_land_or_are_refused():
    """A worker thread posts a layer's kernel-form words in a loop while another thread
    closes the producer's channels: each post stores its signal or is refused with a pdhal
    error; none writes through a closed channel."""
    from pdhal._protocol import signals as _signals

    for _ in range(50):
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        words = ops.init_signal_layerwise(meta, 0).kernel_form
        outcome: list[BaseException] = []
        posted = threading.Event()

        def post(words=words, outcome=outcome, posted=posted) -> None:
            try:
                while True:
                    ops.signal_layer_ready(words)
                    posted.set()
            except pdhal.PdhalError as e:
                outcome.append(e)
            finally:
                posted.set()

        thread = threading.Thread(target=post)
        thread.start()
        posted.wait(10)
        _signals.close_producer_channels()
        thread.join(timeout=10)
        assert not thread.is_alive() and len(outcome) == 1, outcome
        assert "does not produce" in str(outcome[0]), outcome[0]


def test_posts_racing_a_sender_close_are_delivered_or_refused():
    """Threads post through one sender while another closes it: every post that returned
    was delivered (the close delivers what is pending), the rest got ClosedHandleError."""
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    sender = ops.create_kv_signal_sender()
    delivered: list[int] = []
    refused: list[BaseException] = []
    start = threading.Barrier(5)

    def post(thread: int) -> None:
        start.wait()
        for layer in range(thread, 4000, 4):
            try:
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), None, sender)
            except pdhal.ClosedHandleError as e:
                refused.append(e)
                return
            delivered.append(layer)

    threads = [threading.Thread(target=post, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    start.wait()
    sender.close()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a poster hung"
    with ops.open_kv_signal_reader(0, 0) as reader:
        step, layer = reader.current()
    assert step == meta.step
    assert layer == (max(delivered) if delivered else -1)
