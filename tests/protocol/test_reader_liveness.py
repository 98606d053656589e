"""The per-chunk reader as the producer sees it, across processes: one reader at a time;
its death is reported to a producer waiting on it, also after other processes opened and
closed the channel meanwhile (`pdhal cleanup --dry-run`, a second producer that was
refused), since only the reader's own clean close means "detached, not dead"."""

from __future__ import annotations

import array
import os
import signal
import subprocess
import sys

import pytest

import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names
from pdhal.testing.fixtures import python_child

READER = """
import array, sys
from pdhal import ops
out = array.array("i", [0] * 1538)
reader = ops.open_kv_chunk_reader(0, 0, timeout=30)
reader.next(out, timeout=30)
print("attached", flush=True)
sys.stdin.read()  # holds the reader until killed
"""


SECOND_PRODUCER = "from pdhal import ops; ops.init_kv_signal_per_query([2], [2], [0], 0, 1)"


def _attached_reader() -> subprocess.Popen:
    chunk = ops.init_kv_signal_per_query([1], [1], [0], 0, 1)
    ops.signal_layer_ready(chunk.layer(0))
    reader = python_child(READER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline() == "attached\n"
    return reader


def test_a_reader_killed_after_others_opened_the_channel_is_reported_dead(monkeypatch):
    reader = _attached_reader()
    try:
        dry = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdhal",
                "cleanup",
                "--dry-run",
                "--namespace",
                os.environ["PDHAL_NAMESPACE"],
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "0 dead segment(s) to remove" in dry.stdout, dry.stdout
        second = subprocess.run(
            [sys.executable, "-c", SECOND_PRODUCER], check=False, capture_output=True, text=True
        )
        assert second.returncode == 1 and "already has a live producer" in second.stderr
    finally:
        reader.send_signal(signal.SIGKILL)
        reader.wait()
    monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", "5")
    died = rf"\(pid {reader.pid}\) died with step 1 unread"
    with pytest.raises(pdhal.ReaderDiedError, match=died):
        for step in range(2, 2 + _core.DEFAULT_RING_SLOTS + 1):  # one more than fits
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, 1)
            ops.signal_layer_ready(chunk.layer(0))


def test_one_reader_at_a_time():
    reader = _attached_reader()
    try:
        with pytest.raises(pdhal.ChannelBusyError, match="already has a reader attached"):
            ops.open_kv_chunk_reader(0, 0, timeout=5)
    finally:
        reader.stdin.close()
        assert reader.wait(timeout=30) == 0
    with ops.open_kv_chunk_reader(0, 0, timeout=5) as reader:  # its exit detached it
        out = array.array("i", [0] * 1538)
        assert reader.next(out, wait=False) == 1  # delivered to the first, never acknowledged


def test_an_open_flag_this_pdhal_does_not_know_is_refused():
    ops.init_kv_signal_per_query([1], [1], [0], 0, 1)
    path = _names.channel_path("chunk", 0, 0)
    with pytest.raises(pdhal.SegmentError, match="unknown open flags 0x80"):
        _core.Segment.open(path, _core.KIND_CHUNK, 5, 1 << 7)
