"""What the demo measured: the timeline, exposed transfer and overlap efficiency per request,
throughput and time to first token.

Every time is an integer of CLOCK_MONOTONIC nanoseconds (time.monotonic_ns), read on the
prefill host: by the worker (a layer's end and the time it signalled a layer, each read
before its signal is posted), the messager (a transfer's start and end, and a request's
first submit and landing: the streamer's own records) and the parent (the start, and a
request's insertion on decode). Integers keep the arithmetic exact, so the bounds below hold
to the nanosecond.

Definitions: pdhal.transfer's (pdhal/_transfer/metrics.py states them; the functions are
TransferMetrics' static methods, imported here, not written again):
- exposed transfer of a request (the headline): landed - its last layer's signal, the time
  the *worker* read just before posting it (the messager only knows when it woke). Every
  transfer starts after its layer's signal (causality: the worker reads the time before it
  posts the signal that wakes the messager), so this is >= 0.
- overlap efficiency of a request: the share of its first submit -> landed that lay before
  that signal (~0 when every layer is signalled after the forward pass).
- exposed_ms_p50 / exposed_ms_p99 (slow tail) and overlap_efficiency_p50 /
  overlap_efficiency_p1 (low tail): nearest-rank percentiles over every request of the run
  (and rank): with fewer than 100, p99 is the largest and p1 the smallest.
- transfer busy time: the union of the transfer intervals (time in which at least one
  transfer was in flight); transfer throughput: bytes moved / transfer busy time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from pdhal.transfer import TransferMetrics

NS = 1_000_000_000


@dataclass
class Timeline:
    start: int = 0  # ns: the worker was told to go
    step_start: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, step) -> ns
    step_index: dict[tuple[int, int], int] = field(default_factory=dict)  # -> plan.steps[i]
    layer_end: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (rank, step, layer)
    signal: dict[tuple[int, int, int], int] = field(default_factory=dict)  # layer signal posted
    # (rank, step, layer) -> the worker's time read just before it posted the layer's signal
    signalled: dict[tuple[int, int, int], int] = field(default_factory=dict)
    transfers: list[dict] = field(default_factory=list)  # messager "xfer" events
    # (rank, request) -> (first submit, landed): the streamer's record of the request
    landed: dict[tuple[int, int], tuple[int | None, int]] = field(default_factory=dict)
    inserted: dict[int, int] = field(default_factory=dict)  # request -> on decode, ns

    def compute_intervals(self, rank: int = 0) -> list[tuple[int, int, int]]:
        """(start, end, layer) of every layer rank `rank` computed."""
        out = []
        for (r, step, layer), end in sorted(self.layer_end.items()):
            if r != rank:
                continue
            begin = self.step_start[r, step] if layer == 0 else self.layer_end[r, step, layer - 1]
            out.append((begin, end, layer))
        return out

    def _layer_end_of(self, x: dict) -> int:
        return self.layer_end[x.get("rank", 0), x["step"], x["layer"]]

    def _by_start(self, rank: int | None) -> list[dict]:
        return sorted(
            (x for x in self.transfers if rank is None or x.get("rank", 0) == rank),
            key=lambda x: (x["start"], x["end"]),
        )

    def busy(self, rank: int | None = None) -> int:
        """ns in which at least one transfer (of `rank`, or of any) was in flight."""
        return TransferMetrics.busy_ns((x["start"], x["end"]) for x in self._by_start(rank))

    def measured_end(self, rank: int | None = None) -> int:
        return max(x["end"] for x in self._by_start(rank))

    def causality_violations(self) -> int:
        """Transfers that seem to start before their layer ended (0 unless a clock is off)."""
        return sum(x["start"] < self._layer_end_of(x) for x in self.transfers)

    def start_lag(self, rank: int | None = None) -> int:
        """The longest a transfer (of `rank`) waited after its layer ended before it began."""
        return max(x["start"] - self._layer_end_of(x) for x in self._by_start(rank))


def _prefill_end(timeline: Timeline, plan) -> dict[int, int]:
    """When each request's last layer of its last chunk was computed (by every rank)."""
    ends: dict[int, int] = {}
    for (rank, step), index in timeline.step_index.items():
        for c in plan.steps[index]:
            if c.start + c.length == plan.request(c.request).prompt_len:
                end = timeline.layer_end[rank, step, plan.model.layers - 1]
                ends[c.request] = max(ends.get(c.request, end), end)
    return ends


def _last_signal(timeline: Timeline, plan) -> dict[tuple[int, int], int]:
    """(rank, request) -> when that rank's worker signalled the request's last layer (of
    its last chunk)."""
    last: dict[tuple[int, int], int] = {}
    for (rank, step), index in timeline.step_index.items():
        for c in plan.steps[index]:
            if c.start + c.length == plan.request(c.request).prompt_len:
                at = timeline.signalled.get((rank, step, plan.model.layers - 1))
                if at is not None:
                    last[rank, c.request] = at
    return last


def request_figures(timeline: Timeline, plan, rank: int | None = None) -> list[dict]:
    """Per (rank, request) that landed: its exposed_ns and overlap_efficiency, as
    pdhal.transfer defines them, from the streamer's record of the request (first submit,
    landed) and the worker's own time for its last layer's signal."""
    last = _last_signal(timeline, plan)
    out = []
    for (r, request), (first, landed) in sorted(timeline.landed.items()):
        if rank is None or r == rank:
            signal = last.get((r, request))
            out.append(
                {
                    "rank": r,
                    "request": request,
                    "exposed_ns": TransferMetrics.exposed_ns(signal, landed),
                    "overlap_efficiency": TransferMetrics.overlap_efficiency(first, signal, landed),
                }
            )
    return out


def overlap_figures(rows: list[dict]) -> dict:
    """The percentiles of request_figures' rows, named as TransferMetrics.snapshot names
    them: exposed_ms_p50, exposed_ms_p99 (slow tail), overlap_efficiency_p50,
    overlap_efficiency_p1 (low tail); None where no request landed."""
    exposed = [x["exposed_ns"] / 1e6 for x in rows if x["exposed_ns"] is not None]
    overlap = [x["overlap_efficiency"] for x in rows if x["overlap_efficiency"] is not None]
    p = TransferMetrics.percentile
    return {
        "exposed_ms_p50": p(exposed, 0.5),
        "exposed_ms_p99": p(exposed, 0.99),
        "overlap_efficiency_p50": p(overlap, 0.5),
        "overlap_efficiency_p1": p(overlap, 0.01),
    }


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
        chunk = arrivals[len(arrivals) * w // windows : len(arrivals) * (w + 1) // windows]
        end, moved = chunk[-1], 0
        while i < len(ends) and ends[i][0] <= end:
            moved += ends[i][1]
            i += 1
        seconds = (end - begin) / NS
        out.append(
            {
                "requests": len(chunk),
                "seconds": seconds,
                "requests_per_s": len(chunk) / seconds,
                "gib_s": moved / seconds / 2**30,
            }
        )
        begin = end
    return out


def _ms(ns: float) -> float:
    return ns / 1e6


def _rank(timeline: Timeline, plan, rank: int, device) -> dict:
    busy = timeline.busy(rank)
    moved = sum(x["bytes"] for x in timeline.transfers if x.get("rank", 0) == rank)
    return {
        "rank": rank,
        "device": device,
        "bytes_moved": moved,
        "transfer_busy_s": busy / NS,
        "transfer_throughput_gib_s": moved / (busy / NS) / 2**30 if busy else 0.0,
        **overlap_figures(request_figures(timeline, plan, rank)),
        "max_start_lag_ms": _ms(timeline.start_lag(rank)),
    }


def summarize(
    timeline: Timeline,
    plan,
    verification: dict,
    devices: dict[int, int] | None = None,
    backends: dict[str, str] | None = None,
) -> dict:
    """One run's figures: an element of the "runs" `pdhal demo --json` prints (to_json).

    What ran: mode, transport, layer_signals ("per layer" or "after the forward pass"),
    requests, rejected (prompts that fit no cache), layers, steps, tp, prompt_tokens, sides
    (per side, "prefill" and "decode": the pdhal backend its processes ran on, the tokens
    of its cache blocks and their order, "heads" or "tokens"). What
    moved: bytes_moved (whole blocks), verified_bytes (rows of prompt tokens, every layer,
    K and V), transfer_throughput_gib_s. Times, in the unit their key ends in: compute_s,
    transfer_busy_s, wall_s (to the last byte), ttft_ms and ttft_after_prefill_ms (decode has
    the request, from the start and from its prefill's end). Per request, as pdhal.transfer
    defines them (see the module): exposed_ms_p50, exposed_ms_p99 (slow tail),
    overlap_efficiency_p50, overlap_efficiency_p1 (low tail), over every request and rank.
    causality_violations (0), ranks (the same per tensor-parallel rank, with
    max_start_lag_ms), throughput_windows (requests/s by tenths of the run,
    from 20 requests on), recycled_blocks. The verdict: bad_blocks, bad_tokens, tokens (per
    request: the first token, then those decoded), ok.
    """
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
        "sides": {
            side: {
                "backend": (backends or {}).get(side),
                "block_tokens": model.block_size,
                "order": model.order,
            }
            for side, model in (("prefill", plan.model), ("decode", plan.decode_model))
        },
        # per rank: its transfers alone (a slow rank shows here, and only in its own row)
        "ranks": [
            _rank(timeline, plan, rank, (devices or {}).get(rank)) for rank in range(plan.tp)
        ],
        "prompt_tokens": sum(r.prompt_len for r in plan.requests),
        "bytes_moved": bytes_moved,
        "transfer_busy_s": busy / NS,
        "transfer_throughput_gib_s": bytes_moved / (busy / NS) / 2**30 if busy else 0.0,
        "compute_s": sum(end - begin for begin, end, _ in compute) / NS,
        "wall_s": (timeline.measured_end() - timeline.start) / NS,
        "ttft_ms": {
            "mean": _ms(statistics.fmean(ttft)),
            "p50": _ms(statistics.median(ttft)),
            "max": _ms(max(ttft)),
        },
        "ttft_after_prefill_ms": {
            "mean": _ms(statistics.fmean(after_prefill)),
            "max": _ms(max(after_prefill)),
        },
        # per request (and rank): transfer left after its prefill, the share hidden behind it
        **overlap_figures(request_figures(timeline, plan)),
        "causality_violations": timeline.causality_violations(),
        "throughput_windows": throughput_windows(timeline),
        "recycled_blocks": plan.recycles,
        "verified_bytes": verification["checked_bytes"],
        "bad_blocks": verification["bad_blocks"],
        "bad_tokens": verification["bad_tokens"],
        "tokens": verification["tokens"],  # per request: the first token, then decoded ones
        "ok": not verification["bad_blocks"] and not verification["bad_tokens"],
    }


def _overlap_line(s: dict) -> str:
    """overlap_figures' four, as the summary and the plot print them."""

    def num(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return (
        f"p50 {num(s['exposed_ms_p50'], '.1f')} ms, p99 {num(s['exposed_ms_p99'], '.1f')} ms; "
        f"overlap efficiency p50 {num(s['overlap_efficiency_p50'], '.3f')}, "
        f"p1 {num(s['overlap_efficiency_p1'], '.3f')}"
    )


def format_summary(s: dict) -> str:
    verdict = (
        "every byte verified, decode tokens match the reference"
        if s["ok"]
        else f"MISMATCH: {len(s['bad_blocks'])} blocks, {len(s['bad_tokens'])} token runs"
    )
    lines = [
        f"{s['mode']} over {s['transport']} (signals {s['layer_signals']}): {verdict}",
        f"  requests {s['requests']} ({s['prompt_tokens']} prompt tokens), layers {s['layers']},"
        f" steps {s['steps']}",
        "  "
        + "; ".join(
            f"{side} on {v['backend']}, blocks of {v['block_tokens']} tokens ({v['order']}-major)"
            for side, v in s["sides"].items()
        ),
        f"  moved {s['bytes_moved'] / 2**20:.1f} MiB at {s['transfer_throughput_gib_s']:.2f} GiB/s"
        f" (transfers in flight {1e3 * s['transfer_busy_s']:.1f} ms); verified "
        f"{s['verified_bytes'] / 2**20:.1f} MiB",
        f"  time to first token on decode: mean {s['ttft_ms']['mean']:.0f} ms, "
        f"p50 {s['ttft_ms']['p50']:.0f} ms, max {s['ttft_ms']['max']:.0f} ms; after a "
        f"request's prefill ended: mean {s['ttft_after_prefill_ms']['mean']:.1f} ms, max "
        f"{s['ttft_after_prefill_ms']['max']:.1f} ms",
        f"  compute {s['compute_s']:.2f} s, last byte at {s['wall_s']:.2f} s",
        f"  exposed transfer per request (landed after its last layer's signal): "
        f"{_overlap_line(s)}",
    ]
    if s["throughput_windows"]:
        lines.append(
            "  requests/s by tenths of the run: "
            + ", ".join(f"{w['requests_per_s']:.1f}" for w in s["throughput_windows"])
        )
    if s["tp"] > 1:
        for r in s["ranks"]:
            lines.append(
                f"  rank {r['rank']} (device {r['device']}): {r['bytes_moved'] / 2**20:.1f} "
                f"MiB at {r['transfer_throughput_gib_s']:.2f} GiB/s, exposed transfer "
                f"{_overlap_line(r)}; longest wait before a transfer "
                f"{r['max_start_lag_ms']:.1f} ms"
            )
    for r in s["rejected"]:
        lines.append(f"  rejected a {r['prompt_len']}-token prompt: {r['why']}")
    for bad in s["bad_blocks"][:5]:
        lines.append(
            f"  bad block: request {bad['request']} rank {bad['rank']} layer "
            f"{bad['layer']} {bad['kv']}"
        )
    for bad in s["bad_tokens"][:5]:
        lines.append(f"  bad tokens: request {bad['request']}: {bad['got']} != {bad['expected']}")
    return "\n".join(lines)


#: `pdhal demo --json` prints one object (to_json); its version changes when a field's
#: meaning does or one is removed (added fields keep it). 2: overlap_efficiency and
#: exposed_transfer_ms (whole-run figures) gave way to pdhal.transfer's per-request ones.
SCHEMA_VERSION = 2


def to_json(runs: list[dict]) -> dict:
    """What `pdhal demo --json` prints, as one JSON object:

    {"pdhal_version": "0.1.0", "backend": "cpu", "schema_version": 2, "runs": [...]}

    `backend` is the pdhal backend that ran (PDHAL_PLATFORM or the one selected), `runs` one
    summary (see summarize) per mode run, in the order run (per_query, then per_chunk).
    """
    import pdhal

    return {
        "pdhal_version": pdhal.__version__,
        "backend": pdhal.current_backend(),
        "schema_version": SCHEMA_VERSION,
        "runs": runs,
    }


#: The formats --plot may end in: matplotlib's own list (FigureCanvasBase), once imported.
def plot_formats() -> list[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


LAYER_CMAP = "viridis"  # a layer's colour, the same in the compute and the transfer row
MAX_LABELS = 16  # steps or request groups in a panel labelled by their request ids


def _ids(ids: list[int]) -> str:
    """Request ids as the picture labels them: [0, 1, 2, 3, 6, 7] -> "r0–r3, r6, r7"."""
    out, ids = [], sorted(set(ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"r{ids[i]}–r{ids[j]}")
        else:
            out += [f"r{n}" for n in ids[i : j + 1]]
        i = j + 1
    return ", ".join(out)


def _label(ax, span: float, text: str, x: float, y: float, dy: int, colour: str) -> None:
    """Text by the point (x, y); near the right edge it ends there instead of starting."""
    right = x > 0.85 * span
    ax.annotate(
        text,
        (x, y),
        fontsize=7,
        xytext=(-3 if right else 3, dy),
        textcoords="offset points",
        ha="right" if right else "left",
        color=colour,
    )


def figure(runs: list[tuple]):
    """The timeline picture (a matplotlib Figure, not drawn): one panel per (plan, timeline)
    run. Rows, top to bottom: the prefill worker computing each layer (rank 0's), each layer
    signal it posted, the cache messager's transfer of each layer (a row per rank), each
    request reaching the decode cache. A layer has one colour in both bar rows (the colour
    bar says which); dotted lines start prefill steps, labelled with their requests."""
    import numpy as np
    from matplotlib import colormaps, colors
    from matplotlib.cm import ScalarMappable
    from matplotlib.figure import Figure
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    cmap = colormaps[LAYER_CMAP]
    layers = max(plan.model.layers for plan, _ in runs)
    norm = colors.BoundaryNorm(np.arange(layers + 1) - 0.5, cmap.N)
    heights = [3.0 + 0.45 * plan.tp for plan, _ in runs]
    fig = Figure(figsize=(13, sum(heights) + 1.6), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (plan, t) in zip(axes, runs):

        def ms(ns: int, start: int = t.start) -> float:
            return (ns - start) / 1e6

        rank0 = "\n(rank 0)" if plan.tp > 1 else ""
        rows = [f"worker: compute{rank0}", f"layer signal{rank0}"]
        rows += [
            f"messager rank {r}:\ntransfer" if plan.tp > 1 else "messager: transfer"
            for r in range(plan.tp)
        ]
        rows.append("decode: request\nin its cache")
        y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}  # first row on top
        compute = t.compute_intervals()
        ax.broken_barh(
            [(ms(b), (e - b) / 1e6) for b, e, _ in compute],
            (y[rows[0]] - 0.35, 0.7),
            facecolors=[cmap(norm(layer)) for *_, layer in compute],
            edgecolors="white",  # between layers, unless that is all one would see
            linewidth=0.4 if len(compute) <= 300 else 0,
        )
        ticks = [ms(at) for (rank, _, _), at in t.signal.items() if rank == 0]
        ax.vlines(ticks, y[rows[1]] - 0.3, y[rows[1]] + 0.3, colors="black", linewidth=0.7)
        for rank in range(plan.tp):
            row = y[rows[2 + rank]]
            mine = [x for x in t.transfers if x.get("rank", 0) == rank]
            shades = [cmap(norm(x["layer"])) for x in mine]
            ax.broken_barh(
                [(ms(x["start"]), (x["end"] - x["start"]) / 1e6) for x in mine],
                (row - 0.35, 0.7),
                facecolors=shades,
                edgecolors=shades,
                linewidth=0.8,
            )  # a transfer far shorter than a pixel still shows
        # Requests on decode; those a few pixels apart share one label.
        row = y[rows[-1]]
        arrivals = sorted((ms(at), r) for r, at in t.inserted.items())
        span = max([ms(x["end"]) for x in t.transfers] + [a for a, _ in arrivals] + [1.0])

        ax.plot(
            [a for a, _ in arrivals],
            [row] * len(arrivals),
            linestyle="none",
            marker="v",
            color="tab:red",
            markersize=6,
        )
        groups: list[list] = []
        for at, r in arrivals:
            if groups and at - groups[-1][0][0] < span / 60:
                groups[-1].append((at, r))
            else:
                groups.append([(at, r)])
        if len(plan.requests) <= MAX_LABELS:
            for group in groups:
                _label(ax, span, _ids([r for _, r in group]), group[0][0], row, -12, "tab:red")
        # Steps: where each began (rank 0), and the requests it computed.
        starts = sorted(
            (ms(at), t.step_index[key])
            for key, at in t.step_start.items()
            if key[0] == 0 and key in t.step_index
        )
        for at, _ in starts if len(starts) <= 3 * MAX_LABELS else []:  # else a grey wash
            ax.axvline(at, color="grey", linestyle=":", linewidth=0.8)
        if len(starts) <= MAX_LABELS:
            for at, index in starts:
                _label(
                    ax,
                    span,
                    f"step {index}: {_ids([c.request for c in plan.steps[index]])}",
                    at,
                    len(rows) - 0.5,
                    2,
                    "dimgrey",
                )
        ax.set_yticks(list(y.values()), list(y))
        ax.set_ylim(-0.6, len(rows) - 0.1)
        ax.set_xlim(-0.01 * span, 1.01 * span)
        ax.set_xlabel("time since the prefill worker started (ms)")
        signals = "after the forward pass" if plan.signal_at_end else "per layer"
        ax.set_title(
            f"{plan.mode} over {plan.transport}: {len(plan.requests)} requests, "
            f"{plan.model.layers} layers, {len(plan.steps)} "
            f"step{'s' if len(plan.steps) > 1 else ''}, signals {signals}"
            + (f", {plan.tp} tensor-parallel ranks" if plan.tp > 1 else "")
            + " — exposed transfer per request "
            + _overlap_line(overlap_figures(request_figures(t, plan))),
            fontsize=10,
        )
    fig.suptitle(
        "pdhal demo: prefill worker → layer signal → cache messager → decode cache", fontsize=11
    )
    bar = fig.colorbar(ScalarMappable(norm, cmap), ax=list(axes), pad=0.01, aspect=40)
    bar.set_label("layer (the colour of its compute and transfer bars)")
    bar.set_ticks(sorted({*range(0, layers, max(1, round(layers / 8))), layers - 1}))
    # A layer's colour is not the row's: each bar entry shows three layers' colours.
    shades = [cmap(norm(layer)) for layer in (0, layers // 2, layers - 1)]
    handles = [
        tuple(Patch(facecolor=c, edgecolor="white") for c in shades),
        tuple(
            Line2D([], [], color=c, marker="|", linestyle="none", markersize=10, markeredgewidth=2)
            for c in shades
        ),
        Line2D(
            [], [], color="black", marker="|", linestyle="none", markersize=10, markeredgewidth=1
        ),
        Line2D([], [], color="tab:red", marker="v", linestyle="none"),
        Line2D([], [], color="grey", linestyle=":"),
    ]
    labels = [
        "compute: the worker runs one layer, writing its K/V (colour: which layer)",
        "transfer: the messager copies that layer's KV blocks to decode (same colour)",
        "layer signal: posted by the worker through pdhal, it wakes the messager",
        "rN: request N is in the decode cache, its first token known",
        "step k: a prefill step starts; rN: the requests it computes",
    ]
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=2,
        fontsize=8,
        frameon=False,
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
    )
    return fig


def plot(runs: list[tuple], path: str) -> None:
    """Write figure(runs) to `path` (the format its extension names)."""
    figure(runs).savefig(path, dpi=110)
