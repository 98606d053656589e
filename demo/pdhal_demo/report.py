"""What the demo measured: the timeline, overlap efficiency, throughput and time to first token.

All times are CLOCK_MONOTONIC seconds taken in the demo's processes on one host.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Timeline:
    start: float = 0.0  # the worker was told to go
    step_start: dict[int, float] = field(default_factory=dict)  # channel step -> start
    step_index: dict[int, int] = field(default_factory=dict)  # channel step -> plan.steps[i]
    layer_end: dict[tuple[int, int], float] = field(default_factory=dict)  # (step, layer)
    transfers: list[dict] = field(default_factory=list)  # messager "xfer" events
    inserted: dict[int, float] = field(default_factory=dict)  # request -> on decode

    def compute_intervals(self) -> list[tuple[float, float, int]]:
        """(start, end, layer) of every layer computed."""
        out = []
        for (step, layer), end in sorted(self.layer_end.items()):
            begin = self.step_start[step] if layer == 0 else self.layer_end[step, layer - 1]
            out.append((begin, end, layer))
        return out

    def ideal_end(self) -> float:
        """When the last transfer would end if each began the moment its layer was computed
        and the previous transfer was done (measured compute and transfer durations)."""
        t = self.start
        for x in sorted(self.transfers, key=lambda x: x["start"]):
            t = max(t, self.layer_end[x["step"], x["layer"]]) + (x["end"] - x["start"])
        return t

    def measured_end(self) -> float:
        return max(x["end"] for x in self.transfers)

    def overlap_efficiency(self) -> float:
        return (self.ideal_end() - self.start) / (self.measured_end() - self.start)


def _prefill_end(timeline: Timeline, plan) -> dict[int, float]:
    """When each request's last layer of its last chunk was computed."""
    ends = {}
    for step, index in timeline.step_index.items():
        for c in plan.steps[index]:
            if c.start + c.length == plan.request(c.request).prompt_len:
                ends[c.request] = timeline.layer_end[step, plan.model.layers - 1]
    return ends


def summarize(timeline: Timeline, plan, verification: dict) -> dict:
    bytes_moved = sum(x["bytes"] for x in timeline.transfers)
    busy = sum(x["end"] - x["start"] for x in timeline.transfers)
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
        "prompt_tokens": sum(r.prompt_len for r in plan.requests),
        "bytes_moved": bytes_moved,
        "transfer_throughput_gib_s": bytes_moved / busy / 2**30 if busy else 0.0,
        "compute_s": sum(end - begin for begin, end, _ in compute),
        "wall_s": timeline.measured_end() - timeline.start,
        "ttft_ms": {"mean": 1e3 * statistics.fmean(ttft), "p50": 1e3 * statistics.median(ttft),
                    "max": 1e3 * max(ttft)},
        "ttft_after_prefill_ms": {"mean": 1e3 * statistics.fmean(after_prefill),
                                  "max": 1e3 * max(after_prefill)},
        "overlap_efficiency": timeline.overlap_efficiency(),
        # transfer time not hidden behind compute: last byte sent after the last layer computed
        "exposed_transfer_ms": 1e3 * (timeline.measured_end() - max(timeline.layer_end.values())),
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
        f"; verified {s['verified_bytes'] / 2**20:.1f} MiB",
        f"  time to first token on decode: mean {s['ttft_ms']['mean']:.0f} ms, "
        f"p50 {s['ttft_ms']['p50']:.0f} ms, max {s['ttft_ms']['max']:.0f} ms; after a "
        f"request's prefill ended: mean {s['ttft_after_prefill_ms']['mean']:.1f} ms, max "
        f"{s['ttft_after_prefill_ms']['max']:.1f} ms",
        f"  compute {s['compute_s']:.2f} s, last byte at {s['wall_s']:.2f} s "
        f"({s['exposed_transfer_ms']:.1f} ms after the last layer), "
        f"overlap efficiency {s['overlap_efficiency']:.3f}",
    ]
    for r in s["rejected"]:
        lines.append(f"  rejected a {r['prompt_len']}-token prompt: {r['why']}")
    for bad in s["bad_blocks"][:5]:
        lines.append(f"  bad block: request {bad['request']} layer {bad['layer']} {bad['kv']}")
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
        ax.broken_barh([(1e3 * (b - t.start), 1e3 * (e - b)) for b, e, _ in compute], (10, 8),
                       facecolors=[["tab:blue", "tab:cyan"][layer % 2] for _, _, layer in compute])
        ax.broken_barh([(1e3 * (x["start"] - t.start), 1e3 * (x["end"] - x["start"]))
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
