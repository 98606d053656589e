"""The numbers that show whether a transfer overlapped the model's compute: per layer
(signal to submit, submit to landed, bytes) and per request (exposed transfer: landed
minus its last layer's signal; overlap efficiency: the share of its transfer time hidden
behind compute; throughput), as a snapshot dict, JSON or Prometheus text."""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import asdict, dataclass

#: Per-layer records kept for layers() (the newest; older ones only count in the totals).
KEEP = 4096


@dataclass(frozen=True)
class LayerRecord:
    """One submit (one layer's runs to one destination), once it landed or failed."""

    layer: int
    requests: int
    nbytes: int
    signal_ns: int  # when the layer's signal was seen (time.monotonic_ns)
    submit_ns: int
    end_ns: int
    landed: bool
    step: int | None = None  # the engine's step, if layer_ready was told


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class TransferMetrics:
    """Counters and recent records of one streamer; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._layers: collections.deque[LayerRecord] = collections.deque(maxlen=KEEP)
        self._requests: collections.deque[dict] = collections.deque(maxlen=KEEP)
        self.bytes_landed = 0
        self.layers_landed = self.layers_failed = 0
        self.requests_landed = self.requests_failed = 0
        self._first_submit_ns: int | None = None
        self._recorded = 0  # layer records ever made: the next one's number
        self._last_landed_ns: int | None = None

    def layer(self, record: LayerRecord) -> None:
        with self._lock:
            self._layers.append(record)
            self._recorded += 1
            if self._first_submit_ns is None:
                self._first_submit_ns = record.submit_ns
            if record.landed:
                self.layers_landed += 1
                self.bytes_landed += record.nbytes
                self._last_landed_ns = record.end_ns
            else:
                self.layers_failed += 1

    def request(self, landed: bool, nbytes: int, first_submit_ns, last_signal_ns, end_ns) -> None:
        with self._lock:
            if not landed:
                self.requests_failed += 1
                return
            self.requests_landed += 1
            duration = end_ns - first_submit_ns if first_submit_ns is not None else 0
            exposed = end_ns - last_signal_ns if last_signal_ns is not None else duration
            self._requests.append(
                {
                    "bytes": nbytes,
                    "duration_ms": duration / 1e6,
                    "exposed_ms": max(exposed, 0) / 1e6,
                    "overlap": 1.0 - min(max(exposed, 0) / duration, 1.0) if duration > 0 else 1.0,
                }
            )

    def layers(self) -> list[LayerRecord]:
        """The newest per-layer records, oldest first."""
        with self._lock:
            return list(self._layers)

    def layers_since(self, mark: int = 0) -> tuple[list[LayerRecord], int]:
        """The layer records made since `mark` (records are numbered from 0; only the newest
        are kept), and the mark to pass next time: an exporter's cursor."""
        with self._lock:
            kept = len(self._layers)
            first = self._recorded - kept  # the oldest kept record's number
            return list(self._layers)[max(mark - first, 0) :], self._recorded

    def snapshot(self) -> dict:
        """Totals, and medians / p99 over the newest records."""
        with self._lock:
            layers, requests = list(self._layers), list(self._requests)
            window = (
                (self._last_landed_ns - self._first_submit_ns) / 1e9
                if self._first_submit_ns is not None and self._last_landed_ns is not None
                else 0.0
            )
            out = {
                "bytes_landed": self.bytes_landed,
                "layers_landed": self.layers_landed,
                "layers_failed": self.layers_failed,
                "requests_landed": self.requests_landed,
                "requests_failed": self.requests_failed,
                "throughput_gb_s": self.bytes_landed / window / 1e9 if window > 0 else None,
            }
        landed = [r for r in layers if r.landed]
        to_submit = [(r.submit_ns - r.signal_ns) / 1e3 for r in landed]
        in_flight = [(r.end_ns - r.submit_ns) / 1e3 for r in landed]
        for name, values in (
            ("signal_to_submit_us", to_submit),
            ("submit_to_landed_us", in_flight),
            ("exposed_ms", [r["exposed_ms"] for r in requests]),
            ("overlap_efficiency", [r["overlap"] for r in requests]),
        ):
            out[f"{name}_p50"] = _percentile(values, 0.5)
            out[f"{name}_p99"] = _percentile(values, 0.99)
        return out

    def to_json(self) -> str:
        """The snapshot and the newest layer records as one JSON object."""
        return json.dumps(
            {"snapshot": self.snapshot(), "layers": [asdict(r) for r in self.layers()]}
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
