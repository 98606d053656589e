"""The numbers that show whether a transfer overlapped the model's compute, as a snapshot
dict, JSON or Prometheus text. Every time is time.monotonic_ns() of the prefill host.

Definitions (the one place they are made; the demo and the benchmarks import them):

- A request's **last signal**: the `signal_ns` its last layer was signalled with (the
  prompt whole): when the *engine* signalled it, which `layer_ready` is told, not when the
  streamer or a messager saw it. A messager woken late would otherwise hide the wait.
- **Landed**: when the request ended landed (its landed word is in the decode side's slot).
- **Exposed transfer** (`exposed_ns`; `exposed_ms` per request, the headline): landed minus
  the last signal. It is what the decode side waits for after the prefill's compute ended,
  the time layer-wise streaming exists to remove: about one layer's copy when each layer
  went as it was computed, the whole transfer when every layer was signalled at the end.
- **Transfer window** of a request: its first submit (of any of its layers) to landed.
- **Overlap efficiency** (`overlap_efficiency`): the share of the transfer window that lay
  before the last signal, i.e. ran while the engine was still computing:
  clamp((last signal - first submit) / (landed - first submit), 0, 1), which is
  1 - exposed / window when the transfer began before the last signal. Signalled at the
  end, every submit follows the last signal: ~0. Layer-wise with copies faster than the
  compute: all but the last layer's copy (and the landed word) is in the window before the
  last signal: near 1. The window, not the sum of the layers' submit-to-landed times,
  because a request's own record holds it (a layer record is one submit, shared by the
  requests it carries) and a gap in which the transfer waited for the next layer is
  compute the transfer was hidden behind. None when nothing of the request was submitted
  (its prompt was all cached) or its last signal is unknown.
- **Busy time**: the union of the [submit, end] intervals of landed layer records (time in
  which at least one submit was in flight, never the compute between them);
  **busy throughput** (`busy_throughput_gb_s`): their bytes / busy time, 1e9 bytes/s.
- **Percentiles** are nearest-rank over the window: the landed ones among the newest KEEP
  layer records and the newest KEEP requests that ended. `_p50` is the median; `_p99` of a
  time is its slow tail (99% of the window at or below it; with fewer than 100 in the
  window, the largest); the bad tail of an efficiency is the low one, so
  `overlap_efficiency_p1` (99% at or above it; with fewer than 100, the smallest).
"""

from __future__ import annotations

import collections
import json
import math
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass

#: Layer records and request records kept (their landed ones are the window of snapshot()'s
#: percentiles and busy throughput; layers()/requests() return them); totals count all.
KEEP = 4096


def exposed_ns(last_signal_ns: int | None, landed_ns: int) -> int | None:
    """Exposed transfer: landed minus the last signal (None when the signal is unknown)."""
    return None if last_signal_ns is None else landed_ns - last_signal_ns


def overlap_efficiency(
    first_submit_ns: int | None, last_signal_ns: int | None, landed_ns: int
) -> float | None:
    """The share of first submit -> landed that lay before the last signal, in [0, 1]."""
    if first_submit_ns is None or last_signal_ns is None:
        return None
    window = landed_ns - first_submit_ns
    if window <= 0:
        return None
    return min(max((last_signal_ns - first_submit_ns) / window, 0.0), 1.0)


def busy_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """The length of the union of (start, end) intervals: time in which any was open."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        lo = start if reach is None else max(start, reach)
        if end > lo:
            total += end - lo
        reach = end if reach is None else max(reach, end)
    return total


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile `q` (0 < q <= 1) of `values`; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


@dataclass(frozen=True)
class LayerRecord:
    """One submit (one layer's runs to one destination), once it landed or failed."""

    layer: int
    requests: int
    nbytes: int
    signal_ns: int  # when the engine signalled the layer (layer_ready's signal_ns)
    submit_ns: int
    end_ns: int
    landed: bool
    step: int | None = None  # the engine's step, if layer_ready was told


@dataclass(frozen=True)
class RequestRecord:
    """One request's transfer, once it ended (landed or failed)."""

    request_id: str | None
    landed: bool
    nbytes: int
    first_submit_ns: int | None  # its first submit (None: nothing of it was submitted)
    last_signal_ns: int | None  # its last layer's signal_ns (the engine's)
    end_ns: int  # it landed (or failed)

    @property
    def exposed_ns(self) -> int | None:
        """Landed minus the last signal (None unless it landed)."""
        return exposed_ns(self.last_signal_ns, self.end_ns) if self.landed else None

    @property
    def overlap_efficiency(self) -> float | None:
        """The share of its transfer window before its last signal (None unless landed)."""
        if not self.landed:
            return None
        return overlap_efficiency(self.first_submit_ns, self.last_signal_ns, self.end_ns)


class TransferMetrics:
    """Counters and recent records of one streamer; thread-safe. The definitions are the
    module's (pdhal._transfer.metrics); its functions are here too, as static methods, for
    a reader that measured its own times (the demo)."""

    exposed_ns = staticmethod(exposed_ns)
    overlap_efficiency = staticmethod(overlap_efficiency)
    busy_ns = staticmethod(busy_ns)
    percentile = staticmethod(percentile)

    def __init__(self):
        self._lock = threading.Lock()
        self._layers: collections.deque[LayerRecord] = collections.deque(maxlen=KEEP)
        self._requests: collections.deque[RequestRecord] = collections.deque(maxlen=KEEP)
        self.bytes_landed = 0
        self.layers_landed = self.layers_failed = 0
        self.requests_landed = self.requests_failed = 0
        self._recorded = 0  # layer records ever made: the next one's number
        self._ended = 0  # request records ever made: the next one's number

    def layer(self, record: LayerRecord) -> None:
        with self._lock:
            self._layers.append(record)
            self._recorded += 1
            if record.landed:
                self.layers_landed += 1
                self.bytes_landed += record.nbytes
            else:
                self.layers_failed += 1

    def request(
        self,
        landed: bool,
        nbytes: int,
        first_submit_ns: int | None,
        last_signal_ns: int | None,
        end_ns: int,
        request_id: str | None = None,
    ) -> None:
        """A request ended at `end_ns`: landed (or failed), `nbytes` moved, its first submit
        and its last layer's signal (the engine's time), as the module defines them."""
        record = RequestRecord(request_id, landed, nbytes, first_submit_ns, last_signal_ns, end_ns)
        with self._lock:
            self._requests.append(record)
            self._ended += 1
            if landed:
                self.requests_landed += 1
            else:
                self.requests_failed += 1

    def layers(self) -> list[LayerRecord]:
        """The newest per-layer records, oldest first."""
        with self._lock:
            return list(self._layers)

    def requests(self) -> list[RequestRecord]:
        """The newest per-request records (landed or failed), oldest first."""
        with self._lock:
            return list(self._requests)

    def layers_since(self, mark: int = 0) -> tuple[list[LayerRecord], int]:
        """The layer records made since `mark` (records are numbered from 0; only the newest
        are kept), and the mark to pass next time: an exporter's cursor."""
        with self._lock:
            return _since(self._layers, self._recorded, mark)

    def requests_since(self, mark: int = 0) -> tuple[list[RequestRecord], int]:
        """The request records made since `mark`, and the next mark (as layers_since)."""
        with self._lock:
            return _since(self._requests, self._ended, mark)

    def snapshot(self) -> dict:
        """The figures the module defines, headline first: per request over the landed of
        the newest KEEP requests that ended, exposed_ms_p50 / exposed_ms_p99 (slow tail) and
        overlap_efficiency_p50 / overlap_efficiency_p1 (low tail); per layer over the
        newest KEEP layer records, signal_to_submit_us and submit_to_landed_us (p50, p99:
        slow tail) and busy_throughput_gb_s (the landed ones' bytes over their busy time,
        busy_ms);
        window_requests / window_layers: how many the window holds (a p99 of fewer than
        100 is the largest); then totals since the start (bytes_landed, layers_landed,
        layers_failed, requests_landed, requests_failed). A figure not measured yet is
        None."""
        with self._lock:
            layers, requests = list(self._layers), list(self._requests)
            totals = {
                "bytes_landed": self.bytes_landed,
                "layers_landed": self.layers_landed,
                "layers_failed": self.layers_failed,
                "requests_landed": self.requests_landed,
                "requests_failed": self.requests_failed,
            }
        landed = [r for r in requests if r.landed]
        exposed = [r.exposed_ns / 1e6 for r in landed if r.exposed_ns is not None]
        overlap = [r.overlap_efficiency for r in landed if r.overlap_efficiency is not None]
        done = [r for r in layers if r.landed]
        busy = busy_ns((r.submit_ns, r.end_ns) for r in done)
        to_submit = [(r.submit_ns - r.signal_ns) / 1e3 for r in done]
        in_flight = [(r.end_ns - r.submit_ns) / 1e3 for r in done]
        return {
            "exposed_ms_p50": percentile(exposed, 0.5),
            "exposed_ms_p99": percentile(exposed, 0.99),
            "overlap_efficiency_p50": percentile(overlap, 0.5),
            "overlap_efficiency_p1": percentile(overlap, 0.01),
            "window_requests": len(landed),
            "signal_to_submit_us_p50": percentile(to_submit, 0.5),
            "signal_to_submit_us_p99": percentile(to_submit, 0.99),
            "submit_to_landed_us_p50": percentile(in_flight, 0.5),
            "submit_to_landed_us_p99": percentile(in_flight, 0.99),
            "busy_ms": busy / 1e6,
            "busy_throughput_gb_s": sum(r.nbytes for r in done) / busy if busy else None,
            "window_layers": len(done),
            **totals,
        }

    def to_json(self) -> str:
        """The snapshot and the newest layer and request records (each request with its
        exposed_ns and overlap_efficiency) as one JSON object."""
        return json.dumps(
            {
                "snapshot": self.snapshot(),
                "layers": [asdict(r) for r in self.layers()],
                "requests": [
                    {
                        **asdict(r),
                        "exposed_ns": r.exposed_ns,
                        "overlap_efficiency": r.overlap_efficiency,
                    }
                    for r in self.requests()
                ],
            }
        )

    def to_prometheus(self, prefix: str = "pdhal_transfer") -> str:
        """The snapshot in Prometheus' text exposition format (totals as counters, the rest
        as gauges; a value not measured yet is left out)."""
        lines = []
        for name, value in self.snapshot().items():
            if value is None:
                continue
            kind = "counter" if name.endswith(("_landed", "_failed")) else "gauge"
            metric = f"{prefix}_{name}" + ("_total" if kind == "counter" else "")
            lines += [f"# TYPE {metric} {kind}", f"{metric} {value}"]
        return "\n".join(lines) + "\n"


def _since(kept: collections.deque, made: int, mark: int) -> tuple[list, int]:
    first = made - len(kept)  # the oldest kept record's number
    return list(kept)[max(mark - first, 0) :], made
