"""The async KV signal sender on the cpu backend (the C thread with no device events)."""

from __future__ import annotations

import os
import time

import pytest

import pdhal
from pdhal import ops
from pdhal.testing.fixtures import thread_count, thread_count_settled


def test_signals_through_one_sender_arrive_in_order():
    reader_meta = ops.open_shm_and_get_meta_signal(0, 0)
    with ops.open_kv_signal_reader(0, 0) as reader, ops.create_kv_signal_sender() as sender:
        for layer in range(10000):
            ops.signal_layer_ready(ops.init_signal_layerwise(reader_meta, layer), sender=sender)
        assert reader.wait((1, 9998), timeout=5) == (1, 9999)


def test_destroy_delivers_everything_pending():
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    sender = ops.create_kv_signal_sender()
    for layer in range(1000):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), None, sender)
    ops.destroy_kv_signal_sender(sender)
    assert sender.closed
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (1, 999)
    with pytest.raises(pdhal.ClosedHandleError):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1000), sender=sender)


def test_a_sender_per_step_leaves_no_thread_behind():
    before = thread_count()
    for _ in range(1000):
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        with ops.create_kv_signal_sender() as sender:
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), sender=sender)
    assert thread_count_settled(before) == before
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (1000, 0)


def test_idle_sender_uses_no_cpu():
    with ops.create_kv_signal_sender():
        tid = max(int(t) for t in os.listdir("/proc/self/task"))

        def cpu_ticks():
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime

        start = cpu_ticks()
        time.sleep(1.0)
        assert cpu_ticks() - start <= 1  # at most one clock tick (10 ms) in a second


def test_signal_layer_ready_rejects_non_signals():
    with pytest.raises(pdhal.InvalidTypeError, match="LayerSignal"):
        ops.signal_layer_ready((1, 2))
    with pytest.raises(pdhal.InvalidTypeError, match="KVSignalSender"):
        ops.destroy_kv_signal_sender(object())
