"""What the demo measured: the timeline, overlap efficiency, throughput and time to first token.

Every time is an integer of CLOCK_MONOTONIC nanoseconds (time.monotonic_ns), read on the
prefill host: by the worker (a layer's end, read before its signal is posted), the messager
(a transfer's start, read after the signal woke it, and its end, once the transport said the
bytes are in the decode cache) and the parent (the start, and a request's insertion on decode).
Integers keep the arithmetic exact, so the bounds below hold to the nanosecond.

Definitions (the README states them too):
- transfer busy time: the union of the transfer intervals, time in which at least one
  transfer was in flight (a sum of durations when transfers run one at a time);
  transfer throughput: bytes moved / transfer busy time.
- exposed transfer: the last transfer's end - the last layer's end. Every transfer starts
  after its layer's end (causality: the worker reads the end before it posts the signal
  that wakes the messager), so this is >= 0.
- overlap efficiency: (ideal end - start) / (last transfer's end - start). The ideal end
  replays the transfers in the order they started, each at the earliest of its layer's end
  and the previous transfer's ideal end, for its own share of the busy time (the part of its
  interval no earlier transfer covered). By causality every ideal end is <= the measured
  end of the same transfers, so the efficiency is <= 1; it is 1 when no transfer waited
  for anything but its layer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

NS = 1_000_000_000


@dataclass
class Timeline:
    start: int = 0  # ns: the worker was told to go
    step_start: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, step) -> ns
    step_index: dict[tuple[int, int], int] = field(default_factory=dict)  # -> plan.steps[i]
    layer_end: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (rank, step, layer)
    transfers: list[dict] = field(default_factory=list)  # messager "xfer" events
    inserted: dict[int, int] = field(default_factory=dict)  # request -> on decode, ns

    def compute_intervals(self, rank: int = 0) -> list[tuple[int, int, int]]:
        """(start, end, layer) of every layer rank `rank` computed."""
        out = []
        for (r, step, layer), end in sorted(self.layer_end.items()):
            if r != rank:
                continue
            begin = (self.step_start[r, step] if layer == 0
                     else self.layer_end[r, step, layer - 1])
            out.append((begin, end, layer))
        return out

    def _layer_end_of(self, x: dict) -> int:
        return self.layer_end[x.get("rank", 0), x["step"], x["layer"]]

    def _by_start(self, rank: int | None) -> list[dict]:
        return sorted((x for x in self.transfers if rank is None or x.get("rank", 0) == rank),
                      key=lambda x: (x["start"], x["end"]))

    def busy(self, rank: int | None = None) -> int:
        """ns in which at least one transfer (of `rank`, or of any) was in flight."""
        total, reach = 0, None
        for x in self._by_start(rank):
            lo = x["start"] if reach is None else max(x["start"], reach)
            if x["end"] > lo:
                total += x["end"] - lo
            reach = x["end"] if reach is None else max(reach, x["end"])
        return total

    def ideal_end(self, rank: int | None = None) -> int:
        """When the last transfer would end had each started at its layer's end (or once the
        one before it ended), each taking its own share of the busy time."""
        t, reach = self.start, None
        for x in self._by_start(rank):
            lo = x["start"] if reach is None else max(x["start"], reach)
            share = max(0, x["end"] - lo)
            t = max(t, self._layer_end_of(x)) + share
            reach = x["end"] if reach is None else max(reach, x["end"])
        return t

    def measured_end(self, rank: int | None = None) -> int:
        return max(x["end"] for x in self._by_start(rank))

    def overlap_efficiency(self, rank: int | None = None) -> float:
        return (self.ideal_end(rank) - self.start) / (self.measured_end(rank) - self.start)

    def causality_violations(self) -> int:
        """Transfers that seem to start before their layer ended (0 unless a clock is off)."""
        return sum(x["start"] < self._layer_end_of(x) for x in self.transfers)

    def start_lag(self, rank: int | None = None) -> int:
        """The longest a transfer (of `rank`) waited after its layer ended before it began."""
        return max(x["start"] - self._layer_end_of(x) for x in self._by_start(rank))

    def exposed_transfer(self, rank: int | None = None) -> int:
        last_layer = max(end for (r, _, _), end in self.layer_end.items()
                         if rank is None or r == rank)
        return self.measured_end(rank) - last_layer


def _prefill_end(timeline: Timeline, plan) -> dict[int, int]:
    """When each request's last layer of its last chunk was computed (by every rank)."""
    ends: dict[int, int] = {}
    for (rank, step), index in timeline.step_index.items():
        for c in plan.steps[index]:
            if c.start + c.length == plan.request(c.request).prompt_len:
                end = timeline.layer_end[rank, step, plan.model.layers - 1]
                ends[c.request] = max(ends.get(c.request, end), end)
    return ends


def throughput_windows(timeline: Timeline, windows: int = 10) -> list[dict]:
    """The run cut into `windows` spans of as many requests each, by when decode had them:
    requests and transfer bytes per second in each (a flat curve: nothing degrades as the
    per-chunk ring wraps and the caches fill and free their blocks)."""
    arrivals = sorted(timeline.inserted.values())
    if len(arrivals) < 2 * windows:
        return []
    ends = sorted((x["end"], x["bytes"]) for x in timeline.transfers)
    out, begin, i = [], timeline.start, 0
    for w in range(windows):
        chunk = arrivals[len(arrivals) * w // windows:len(arrivals) * (w + 1) // windows]
        end, moved = chunk[-1], 0
        while i < len(ends) and ends[i][0] <= end:
            moved += ends[i][1]
            i += 1
        seconds = (end - begin) / NS
        out.append({"requests": len(chunk), "seconds": seconds,
                    "requests_per_s": len(chunk) / seconds, "gib_s": moved / seconds / 2**30})
        begin = end
    return out


def _ms(ns: float) -> float:
    return ns / 1e6


def _rank(timeline: Timeline, rank: int, device) -> dict:
    busy = timeline.busy(rank)
    moved = sum(x["bytes"] for x in timeline.transfers if x.get("rank", 0) == rank)
    return {"rank": rank, "device": device, "bytes_moved": moved,
            "transfer_busy_s": busy / NS,
            "transfer_throughput_gib_s": moved / (busy / NS) / 2**30 if busy else 0.0,
            "exposed_transfer_ms": _ms(timeline.exposed_transfer(rank)),
            "max_start_lag_ms": _ms(timeline.start_lag(rank)),
            "overlap_efficiency": timeline.overlap_efficiency(rank)}


def summarize(timeline: Timeline, plan, verification: dict,
              devices: dict[int, int] | None = None) -> dict:
    bytes_moved = sum(x["bytes"] for x in timeline.transfers)
    busy = timeline.busy()
    ttft = [t - timeline.start for t in timeline.inserted.values()]
    prefill_end = _prefill_end(timeline, plan)
    # the part of TTFT that is not compute: from a request's last layer to decode having it
    after_prefill = [t - prefill_end[r] for r, t in timeline.inserted.items()]
    compute = timeline.compute_intervals()
    return {
        "mode": plan.mode,
        "transport": plan.transport,
        "layer_signals": "after the forward pass" if plan.signal_at_end else "per layer",
        "requests": len(plan.requests),
        "rejected": [{"prompt_len": n, "why": why} for n, why in plan.rejected],
        "layers": plan.model.layers,
        "steps": len(plan.steps),
        "tp": plan.tp,
        # per rank: its transfers alone (a slow rank shows here, and only in its own row)
        "ranks": [_rank(timeline, rank, (devices or {}).get(rank)) for rank in range(plan.tp)],
        "prompt_tokens": sum(r.prompt_len for r in plan.requests),
        "bytes_moved": bytes_moved,
        "transfer_busy_s": busy / NS,
        "transfer_throughput_gib_s": bytes_moved / (busy / NS) / 2**30 if busy else 0.0,
        "compute_s": sum(end - begin for begin, end, _ in compute) / NS,
        "wall_s": (timeline.measured_end() - timeline.start) / NS,
        "ttft_ms": {"mean": _ms(statistics.fmean(ttft)), "p50": _ms(statistics.median(ttft)),
                    "max": _ms(max(ttft))},
        "ttft_after_prefill_ms": {"mean": _ms(statistics.fmean(after_prefill)),
                                  "max": _ms(max(after_prefill))},
        "overlap_efficiency": timeline.overlap_efficiency(),
        # transfer time not hidden behind compute: last byte landed after the last layer ended
        "exposed_transfer_ms": _ms(timeline.exposed_transfer()),
        "causality_violations": timeline.causality_violations(),
        "throughput_windows": throughput_windows(timeline),
        "recycled_blocks": plan.recycles,
        "verified_bytes": verification["checked_bytes"],
        "bad_blocks": verification["bad_blocks"],
        "bad_tokens": verification["bad_tokens"],
        "tokens": verification["tokens"],  # per request: the first token, then decoded ones
        "ok": not verification["bad_blocks"] and not verification["bad_tokens"],
    }


def format_summary(s: dict) -> str:
    verdict = ("every byte verified, decode tokens match the reference" if s["ok"] else
               f"MISMATCH: {len(s['bad_blocks'])} blocks, {len(s['bad_tokens'])} token runs")
    lines = [
        f"{s['mode']} over {s['transport']} (signals {s['layer_signals']}): {verdict}",
        f"  requests {s['requests']} ({s['prompt_tokens']} prompt tokens), layers {s['layers']},"
        f" steps {s['steps']}",
        f"  moved {s['bytes_moved'] / 2**20:.1f} MiB at {s['transfer_throughput_gib_s']:.2f} GiB/s"
        f" (transfers in flight {1e3 * s['transfer_busy_s']:.1f} ms); verified "
        f"{s['verified_bytes'] / 2**20:.1f} MiB",
        f"  time to first token on decode: mean {s['ttft_ms']['mean']:.0f} ms, "
        f"p50 {s['ttft_ms']['p50']:.0f} ms, max {s['ttft_ms']['max']:.0f} ms; after a "
        f"request's prefill ended: mean {s['ttft_after_prefill_ms']['mean']:.1f} ms, max "
        f"{s['ttft_after_prefill_ms']['max']:.1f} ms",
        f"  compute {s['compute_s']:.2f} s, last byte at {s['wall_s']:.2f} s "
        f"({s['exposed_transfer_ms']:.1f} ms after the last layer), "
        f"overlap efficiency {s['overlap_efficiency']:.3f}",
    ]
    if s["throughput_windows"]:
        lines.append("  requests/s by tenths of the run: " + ", ".join(
            f"{w['requests_per_s']:.1f}" for w in s["throughput_windows"]))
    if s["tp"] > 1:
        for r in s["ranks"]:
            lines.append(f"  rank {r['rank']} (device {r['device']}): {r['bytes_moved'] / 2**20:.1f} "
                         f"MiB at {r['transfer_throughput_gib_s']:.2f} GiB/s, exposed transfer "
                         f"{r['exposed_transfer_ms']:.1f} ms, longest wait before a transfer "
                         f"{r['max_start_lag_ms']:.1f} ms")
    for r in s["rejected"]:
        lines.append(f"  rejected a {r['prompt_len']}-token prompt: {r['why']}")
    for bad in s["bad_blocks"][:5]:
        lines.append(f"  bad block: request {bad['request']} rank {bad['rank']} layer "
                     f"{bad['layer']} {bad['kv']}")
    for bad in s["bad_tokens"][:5]:
        lines.append(f"  bad tokens: request {bad['request']}: {bad['got']} != "
                     f"{bad['expected']}")
    return "\n".join(lines)


def plot(timelines: list[tuple[str, Timeline]], path: str) -> None:
    """One panel per run: a row of layer compute and a row of layer transfer."""
    try:
        import matplotlib
    except ImportError:
        from pdhal_demo.control import DemoError

        raise DemoError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.8 * len(timelines) + 0.6),
                             squeeze=False)
    for ax, (title, t) in zip(axes[:, 0], timelines):
        compute = t.compute_intervals()
        ax.broken_barh([((b - t.start) / 1e6, (e - b) / 1e6) for b, e, _ in compute], (10, 8),
                       facecolors=[["tab:blue", "tab:cyan"][layer % 2] for _, _, layer in compute])
        ax.broken_barh([((x["start"] - t.start) / 1e6, (x["end"] - x["start"]) / 1e6)
                        for x in t.transfers], (0, 8),
                       facecolors=[["tab:orange", "tab:red"][x["layer"] % 2]
                                   for x in t.transfers],
                       edgecolors=[["tab:orange", "tab:red"][x["layer"] % 2]
                                   for x in t.transfers], linewidth=0.8)  # short ones show
        ax.set_yticks([4, 14], ["transfer", "compute"])
        ax.set_title(f"{title}: overlap efficiency {t.overlap_efficiency():.3f}", fontsize=10)
    axes[-1, 0].set_xlabel("ms since the prefill started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
