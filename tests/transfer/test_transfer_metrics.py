"""pdhal.transfer's overlap numbers (TransferMetrics): what each figure means, on hand-made
records, and that a real transfer signalled layer by layer and one signalled only after
the forward pass are told apart by a wide margin."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest

from pdhal import transfer
from pdhal.testing.fixtures import python_child
from pdhal.testing.transfer_peers import outcomes_until

MS = 1_000_000  # ns

# ---- the definitions, on hand-made records ----------------------------------------------


def test_exposed_transfer_and_overlap_follow_the_engine_s_last_signal():
    """Exposed: landed - last signal. Overlap: the share of first submit -> landed that lay
    before the last signal."""
    m = transfer.TransferMetrics()
    # layer-wise: submits from 10 ms, last signal at 90, landed at 100
    m.request(True, 800, 10 * MS, 90 * MS, 100 * MS, "layer-wise")
    # at the end: last signal at 90, first submit after it (91), landed at 170
    m.request(True, 800, 91 * MS, 90 * MS, 170 * MS, "at-end")
    # nothing of it was submitted (its prompt all cached): exposed, but no overlap
    m.request(True, 0, None, 90 * MS, 92 * MS, "cached")
    m.request(False, 100, 10 * MS, 90 * MS, 500 * MS, "failed")  # in no percentile
    lw, end, cached, failed = m.requests()
    assert [r.request_id for r in (lw, end, cached, failed)] == [
        "layer-wise",
        "at-end",
        "cached",
        "failed",
    ]
    assert lw.exposed_ns == 10 * MS and lw.overlap_efficiency == pytest.approx(80 / 90)
    assert end.exposed_ns == 80 * MS and end.overlap_efficiency == 0.0
    assert cached.exposed_ns == 2 * MS and cached.overlap_efficiency is None
    assert failed.exposed_ns is None and failed.overlap_efficiency is None
    s = m.snapshot()
    assert s["window_requests"] == 3 and s["requests_landed"] == 3 and s["requests_failed"] == 1
    assert s["exposed_ms_p50"] == 10.0 and s["exposed_ms_p99"] == 80.0
    assert s["overlap_efficiency_p50"] == 0.0  # the lower median of [0, 0.89]
    assert s["overlap_efficiency_p1"] == 0.0
    # the functions the demo imports are these same definitions
    assert transfer.TransferMetrics.exposed_ns(90 * MS, 100 * MS) == 10 * MS
    assert transfer.TransferMetrics.overlap_efficiency(10 * MS, 90 * MS, 100 * MS) == 80 / 90
    assert transfer.TransferMetrics.overlap_efficiency(91 * MS, 90 * MS, 170 * MS) == 0.0


def test_throughput_is_over_busy_time_not_the_span():
    """Two submits in flight together count once; the gaps between them (compute) and a
    failed submit's bytes do not count."""
    m = transfer.TransferMetrics()

    def layer(nbytes, submit, end, landed=True):
        m.layer(transfer.LayerRecord(0, 1, nbytes, submit, submit, end, landed))

    layer(1000, 0, 10 * MS)
    layer(1000, 5 * MS, 15 * MS)  # overlaps the first: busy 0..15
    layer(500, 100 * MS, 110 * MS)  # after 85 ms of compute: busy 10 more
    layer(9999, 120 * MS, 200 * MS, landed=False)
    s = m.snapshot()
    assert s["busy_ms"] == 25.0 and s["window_layers"] == 3
    assert s["busy_throughput_gb_s"] == 2500 / (25 * MS)  # bytes per ns = GB/s
    assert s["bytes_landed"] == 2500 and s["layers_failed"] == 1
    assert s["submit_to_landed_us_p50"] == 10_000.0
    assert transfer.TransferMetrics.busy_ns([(0, 10), (5, 15), (100, 110)]) == 25


def test_percentiles_name_their_tail_and_cover_the_newest_requests(monkeypatch):
    """Nearest rank, over the newest KEEP landed requests: p99 of a time is its slow tail,
    p1 of an efficiency its low tail; with fewer than 100, the extreme itself."""
    from pdhal._transfer import metrics

    monkeypatch.setattr(metrics, "KEEP", 100)
    m = transfer.TransferMetrics()
    for _ in range(100):  # an old, slow period: out of the window once 100 newer ones came
        m.request(True, 1, 0, 0, 10_000 * MS)
    for i in range(1, 101):  # exposed i ms, overlap (100 - i) / 100
        m.request(True, 1, -(100 - i) * MS, 0, i * MS)
    s = m.snapshot()
    assert s["window_requests"] == 100 and s["requests_landed"] == 200
    assert s["exposed_ms_p50"] == 50.0 and s["exposed_ms_p99"] == 99.0
    assert s["overlap_efficiency_p50"] == 0.49 and s["overlap_efficiency_p1"] == 0.0
    few = transfer.TransferMetrics()
    for exposed, first in [(3, -3), (1, -99), (2, -18)]:  # overlap 0.5, 0.99, 0.9
        few.request(True, 1, first * MS, 0, exposed * MS)
    s = few.snapshot()
    assert s["exposed_ms_p99"] == 3.0 and s["exposed_ms_p50"] == 2.0
    assert s["overlap_efficiency_p1"] == 0.5 and s["overlap_efficiency_p50"] == 0.9


def test_request_records_have_a_cursor_and_export_with_their_figures():
    m = transfer.TransferMetrics()
    m.request(True, 8, 1 * MS, 3 * MS, 4 * MS, "a")
    records, mark = m.requests_since()
    assert [r.request_id for r in records] == ["a"] and mark == 1
    m.request(True, 8, 1 * MS, 3 * MS, 5 * MS, "b")
    records, mark = m.requests_since(mark)
    assert [r.request_id for r in records] == ["b"] and m.requests_since(mark) == ([], 2)
    decoded = json.loads(m.to_json())
    assert decoded["requests"][0]["exposed_ns"] == 1 * MS
    assert decoded["requests"][1]["overlap_efficiency"] == 0.5
    text = m.to_prometheus()
    assert "# TYPE pdhal_transfer_overlap_efficiency_p1 gauge" in text
    assert "pdhal_transfer_exposed_ms_p99 2.0" in text
    assert "busy_throughput_gb_s" not in text  # not measured yet: no layer landed


# ---- a real transfer, layer-wise against signalled at the end ------------------------------

LAYERS, CACHES = 8, 2
BLOCKS, BLOCK_BYTES, BLOCK_TOKENS = 16, 256 * 1024, 16  # 8 MiB a layer: a copy of a few ms
COMPUTE_S = 0.02  # one layer's compute (a sleep: a device computing, the host's CPU free)
ROUNDS = 3  # requests per mode, interleaved

DECODE = f"""
import json, sys
from pdhal import ops, transfer
L, C, B, BB = {LAYERS}, {CACHES}, {BLOCKS}, {BLOCK_BYTES}
buffers = [[ops.host_alloc(B * BB) for _ in range(C)] for _ in range(L)]
caches = [[b.as_numpy("uint8", (B, BB)) for b in row] for row in buffers]
for row in caches:
    for c in row:
        c[:] = 0  # every page present before the measured copies
receiver = transfer.KVReceiver(transfer.CacheLayout.from_caches(caches), "metrics-decode")
print(json.dumps(receiver.describe()), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command[0] == "expect":
        print(json.dumps(receiver.expect(command[1], 60.0)), flush=True)
    elif command[0] == "wait":
        print(json.dumps(receiver.wait(command[1]).landed), flush=True)
    else:
        break
receiver.close()
for row in buffers:
    for b in row:
        ops.host_free(b)
"""


class _Decode:
    """A decode process of LAYERS layers of BLOCKS blocks of BLOCK_BYTES (transfer_peers'
    Decode has 3 layers of 8 small blocks: too few to tell the two apart)."""

    def __init__(self):
        self.proc = python_child(DECODE, stdin=-1, stdout=-1, text=True)
        self.described = json.loads(self.proc.stdout.readline())

    def ask(self, *command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the decode process exited ({self.proc.wait()})"
        return json.loads(line)

    def close(self):
        self.proc.stdin.write('["exit"]\n')
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0
        self.proc.stdout.close()


def _prefill(streamer, dest, decode, request_id: str, at_end: bool) -> None:
    """One request's forward pass: each layer computed, then signalled (its signal_ns the
    time the engine signalled it), or every layer signalled at once after the last one
    computed (one signal_ns for all: layer 0's copy, which may run on this thread, must
    not count as time before the signals)."""
    blocks = list(range(BLOCKS))
    streamer.add_request(request_id, blocks, BLOCKS * BLOCK_TOKENS)
    streamer.set_destination(request_id, dest, blocks[::-1], decode.ask("expect", request_id))
    ready = [(request_id, BLOCKS * BLOCK_TOKENS)]
    for layer in range(LAYERS):
        time.sleep(COMPUTE_S)
        if not at_end:
            streamer.layer_ready(layer, ready, signal_ns=time.monotonic_ns())
    if at_end:
        signalled = time.monotonic_ns()
        for layer in range(LAYERS):
            streamer.layer_ready(layer, ready, signal_ns=signalled)
    assert outcomes_until(streamer, 1) == [transfer.Outcome(request_id, True)]
    assert decode.ask("wait", request_id) is True


def test_layer_wise_and_signal_at_end_are_told_apart_by_a_wide_margin():
    """The same requests, signalled as each layer is computed and all after the forward
    pass (interleaved): the exposed transfer at the end is several times the layer-wise
    one, and overlap efficiency is near 0 at the end, high layer-wise. A figure measured
    from when the copies began, or from a signal seen only after the copy before it, would
    not tell them apart."""
    decode = _Decode()
    caches = [
        [np.full((BLOCKS, BLOCK_BYTES), layer + 1, np.uint8) for _ in range(CACHES)]
        for layer in range(LAYERS)
    ]
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(caches), BLOCK_TOKENS)
    try:
        dest = streamer.connect(decode.described)
        _prefill(streamer, dest, decode, "warm-up", at_end=True)  # first touch of the mapping
        _, mark = streamer.metrics.requests_since()
        for i in range(ROUNDS):
            _prefill(streamer, dest, decode, f"layer-wise-{i}", at_end=False)
            _prefill(streamer, dest, decode, f"at-end-{i}", at_end=True)
        records, _ = streamer.metrics.requests_since(mark)
    finally:
        streamer.close()
        decode.close()
    lw = [r for r in records if r.request_id.startswith("layer-wise")]
    end = [r for r in records if r.request_id.startswith("at-end")]
    assert len(lw) == len(end) == ROUNDS and all(r.landed for r in records)
    lw_exposed = statistics.median(r.exposed_ns / MS for r in lw)
    end_exposed = statistics.median(r.exposed_ns / MS for r in end)
    lw_overlap = statistics.median(r.overlap_efficiency for r in lw)
    end_overlap = statistics.median(r.overlap_efficiency for r in end)
    figures = (
        f"exposed ms layer-wise {[round(r.exposed_ns / MS, 2) for r in lw]}, at the end "
        f"{[round(r.exposed_ns / MS, 2) for r in end]}; overlap layer-wise "
        f"{[round(r.overlap_efficiency, 3) for r in lw]}, at the end "
        f"{[round(r.overlap_efficiency, 3) for r in end]}"
    )
    print(figures)
    assert end_exposed >= 3 * lw_exposed, figures
    assert end_overlap <= 0.3 < 0.6 <= lw_overlap, figures
