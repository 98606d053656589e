"""Kernel forms and the process's current per-chunk step, at their edges: which step a C
op's "next layer" (pdhal_next_chunk_layer_store) belongs to after steps on other channels,
steps without prefill, a step that could not start; what a forked child can post; what
happens when the channel table is full; and the per-chunk reader's acknowledgement as the
cache messager uses it (ack, then read on).

The op's calls are made through the C core pdhal's Python shares (cffi's `lib`), as an
attention op linked against pdhal.get_library() makes them.
"""

from __future__ import annotations

import array
import glob
import os
import subprocess

import pytest

import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal._protocol import signals as _signals
from pdhal._protocol.core import ffi, lib
from pdhal.testing.fixtures import python_child, run_child

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def _next_layer_store():
    """The op's "next layer of the current step": its store, or None and pdhal's reason."""
    store = lib.pdhal_next_chunk_layer_store()
    if store == ffi.NULL:
        return None, ffi.string(lib.pdhal_last_error()).decode()
    return store, ""


def _post_next_layer() -> None:
    store, why = _next_layer_store()
    assert store is not None, why
    lib.pdhal_store_run(store)


def _records(reader: _signals.ChunkReader) -> list[tuple[int, int, int]]:
    """Every record pending now, as (step, layer, tokens of the first request)."""
    out = array.array("i", [0] * _core.RECORD_WORDS)
    got = []
    while (step := reader.next(out, wait=False)) is not None:
        got.append((step, out[1], out[4]))
    return got


# ---- the current step ------------------------------------------------------------------


def test_an_empty_step_on_another_open_channel_keeps_this_channels_current_step():
    """Device 1's channel exists (it had a prefill step); device 0 then starts a step, and
    device 1 has a step without prefill: the op's next layers still go to device 0's step."""
    ops.init_kv_signal_per_query([5], [5], [0], 0, 1, device_id=1)  # creates device 1's
    _post_next_layer()
    ops.init_kv_signal_per_query([3], [3], [0], 0, 2, device_id=0)
    ops.init_kv_signal_per_query([0], [1], [5], 0, 1, device_id=1)  # decode only, device 1
    _post_next_layer()
    _post_next_layer()
    with ops.open_kv_chunk_reader(0, 0) as reader:
        assert _records(reader) == [(1, 0, 3), (1, 1, 3)]
    with ops.open_kv_chunk_reader(0, 1) as reader:
        assert _records(reader) == [(1, 0, 5)]


def test_a_step_without_prefill_ends_the_last_step_even_half_posted():
    """A decode-only step's layers post nothing: the op's "next layer" must not land in the
    step before it, whose last layer the op has not posted yet."""
    ops.init_kv_signal_per_query([3], [3], [0], 0, 2)
    _post_next_layer()
    ops.init_kv_signal_per_query([0], [1], [3], 0, 2)  # decode only
    store, why = _next_layer_store()
    assert store is None and "no per-chunk step is current" in why, why
    with ops.open_kv_chunk_reader(0, 0) as reader:
        assert _records(reader) == [(1, 0, 3)]


def test_a_step_that_could_not_start_leaves_the_last_step_current(monkeypatch):
    """No messager: the ring's 16 steps fill and the 17th times out (back-pressure). The
    op's next layer still belongs to step 16, not to the step that never started."""
    monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", "0.05")
    for step in range(1, _core.DEFAULT_RING_SLOTS + 1):
        ops.init_kv_signal_per_query([step], [step], [0], 0, 2)
        _post_next_layer()
        if step < _core.DEFAULT_RING_SLOTS:
            _post_next_layer()
    with pytest.raises(pdhal.BackPressureTimeoutError):
        ops.init_kv_signal_per_query([99], [99], [0], 0, 2)
    _post_next_layer()  # step 16's second layer
    store, why = _next_layer_store()
    assert store is None and "step 16 has 2 layers, and all were posted already" in why, why
    with ops.open_kv_chunk_reader(0, 0) as reader:
        got = _records(reader)
    assert got == [
        (step, layer, step) for step in range(1, _core.DEFAULT_RING_SLOTS + 1) for layer in (0, 1)
    ], got


def test_the_read_gets_what_is_left_of_the_timeout_after_attaching(monkeypatch):
    """get_output_kv_signal has one deadline for attaching and reading: time spent waiting
    for the producer's channel is taken off the read's wait. A clock that moves 6 s while
    attaching leaves nothing of a 5 s timeout: the read only takes what is there."""
    chunk = ops.init_kv_signal_per_query([4], [4], [0], 0, 1)
    ops.signal_layer_ready(chunk.layer(0))
    times = iter([100.0, 106.0])

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return next(times)

    given = []
    real_next_into = _signals.ChunkReader._next_into

    def next_into(self, words, capacity, wait, timeout, spin):
        given.append(timeout)
        return real_next_into(self, words, capacity, wait, timeout, spin)

    monkeypatch.setattr(_signals, "time", Clock)
    monkeypatch.setattr(_signals.ChunkReader, "_next_into", next_into)
    out = array.array("i", [0] * _core.RECORD_WORDS)
    ops.get_output_kv_signal(out, 0, True, timeout=5)
    assert given == [0.0] and list(out[:5]) == [1, 0, 0, 0, 4]


# ---- a forked child ----------------------------------------------------------------------

FORKED = """
import array, os
from pdhal import ops
from pdhal._protocol.core import ffi, lib

meta = ops.open_shm_and_get_meta_signal(0, 0)
words = ffi.new("int64_t[]", list(ops.init_signal_layerwise(meta, 0).kernel_form))
ops.init_kv_signal_per_query([3], [3], [0], 0, 2)  # the current per-chunk step
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the child: the parent's words and step are not its own
    reasons = []
    for lookup in (lambda: lib.pdhal_signal_store(words), lib.pdhal_next_chunk_layer_store):
        store = lookup()
        if store == ffi.NULL:
            reasons.append(ffi.string(lib.pdhal_last_error()).decode())
        else:
            lib.pdhal_store_run(store)  # what the bug would do: post into the parent's
            reasons.append("posted")
    os.write(w, "|".join(reasons).encode())
    os._exit(0)
os.close(w)
reasons = os.read(r, 4096).decode().split("|")
assert os.waitpid(pid, 0)[1] == 0
assert len(reasons) == 2, reasons
assert "which this process does not produce" in reasons[0], reasons
assert "no per-chunk step is current" in reasons[1], reasons
with ops.open_kv_signal_reader(0, 0) as reader:
    assert reader.current() == (meta.step, -1), reader.current()
with ops.open_kv_chunk_reader(0, 0) as reader:
    assert reader.next(array.array("i", [0] * 1538), wait=False) is None  # nothing posted
# the parent's own forms still post
lib.pdhal_store_run(lib.pdhal_signal_store(words))
with ops.open_kv_signal_reader(0, 0) as reader:
    assert reader.current() == (meta.step, 0)
"""


def test_a_forked_child_cannot_post_through_its_parents_kernel_forms():
    """A worker that forks (a data loader, a helper): the child inherits the mappings and
    the table's memory, but its op must not post into its parent's channels through the
    parent's words or the parent's current per-chunk step."""
    run_child(FORKED)


# ---- a full table --------------------------------------------------------------------------


def test_the_1025th_channel_is_refused_and_a_closed_one_makes_room():
    """1024 channels of one process have kernel forms at once; the next is refused
    (SystemResourceError, ENFILE), not written past the table; closing them makes room."""
    forms = []
    for rank in range(1024):
        meta = ops.open_shm_and_get_meta_signal(rank, 0)
        forms.append(ops.init_signal_layerwise(meta, 0).kernel_form)
    assert len({form[1] for form in forms}) == 1024, "two channels share an id"
    extra = ops.open_shm_and_get_meta_signal(1024, 0)
    with pytest.raises(pdhal.SystemResourceError, match="more than 1024 channels registered"):
        _ = ops.init_signal_layerwise(extra, 0).kernel_form
    _signals.close_producer_channels()  # every registration gone
    meta = ops.open_shm_and_get_meta_signal(7, 0)
    form = ops.init_signal_layerwise(meta, 3).kernel_form
    assert form[1] not in {old[1] for old in forms}, "a new registration reused an old id"
    ops.signal_layer_ready(form)
    with ops.open_kv_signal_reader(7, 0) as reader:
        assert reader.current() == (meta.step, 3)


# ---- acknowledgement ---------------------------------------------------------------------

MESSAGER = """
import array, sys
from pdhal import ops
out = array.array("i", [0] * 1538)
with ops.open_kv_chunk_reader(0, 0, timeout=30) as reader:
    first = reader.next(out, timeout=30), out[1], out[4]
    reader.ack()  # e.g. after sending the layer, before looking for the next
    second = reader.next(out, timeout=30), out[1], out[4]
    reader.ack()  # a clean stop: the next reader starts after step 2
ops.get_output_kv_signal(out, 0, True, timeout=30)
third = out[1], out[4]
ops.ack_kv_signal(0)
ops.get_output_kv_signal(out, 0, True, timeout=30)
print(first, second, third, (out[1], out[4]), flush=True)
"""


def test_a_messager_reads_on_after_acknowledging():
    """ack() (and ack_kv_signal) leave the reader ready for the next record."""
    for step in (1, 2, 3, 4):
        chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, 1)
        ops.signal_layer_ready(chunk.layer(0))
    child = python_child(MESSAGER, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out == "(1, 0, 1) (2, 0, 2) (0, 3) (0, 4)\n"


def test_the_table_is_never_accessed_past_its_end(tmp_path):
    """tests/c/kernel_table.c under AddressSanitizer: 1024 channels, then one refused."""
    binary = str(tmp_path / "kernel_table")
    root = os.path.dirname(TESTS)
    subprocess.run(
        [
            "gcc",
            "-std=gnu11",
            "-O1",
            "-g",
            "-fsanitize=address",
            "-fno-omit-frame-pointer",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{pdhal.get_include()}",
            f"-I{os.path.join(root, 'csrc')}",
            "-o",
            binary,
            os.path.join(TESTS, "c", "kernel_table.c"),
            *sorted(glob.glob(os.path.join(root, "csrc", "*.c"))),
            "-lpthread",
        ],
        check=True,
    )
    folder = tmp_path / "segments"
    folder.mkdir(mode=0o700)
    proc = subprocess.run(
        [binary, str(folder)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not os.listdir(folder)
