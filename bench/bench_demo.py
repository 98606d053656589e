"""The demo's pipeline, measured side by side in one run (these machines are shared and noisy:
every comparison interleaves its rounds and reports the best and the median of each side).

1. Layer-wise streaming against posting every layer only after the forward pass (same
   model, prompts and transport), for both transports: time to first token on decode, also
   counted from the end of each request's prefill (compute time varies run to run on a
   shared machine; this part does not), exposed transfer and overlap efficiency per request
   (p50; pdhal.transfer's definitions, docs/api.md). Target: overlap efficiency p50 >= 0.9.
2. `shm` transport against a memcpy of the same block runs, between two prefaulted host
   buffers the size of the two caches, in this process. Target >= 0.9x. The transport is
   measured standalone (the messager alone on a core: every layer posted after the forward
   pass, one step); the in-pipeline figure, the model computing on the other core, is
   printed too.
3. Mooncake (TCP on loopback) in the demo, standalone likewise, against Mooncake's own
   transfer_engine_bench with the same block size, batch and threads on loopback. Target
   >= 0.9x.
4. Two tensor-parallel ranks, one with a slow link: per-rank exposed transfer and the
   longest wait before a transfer (a slow rank stalls only itself).
5. Many requests through small caches: requests/s and transfer GiB/s by tenths of the run.

Run: .venv/bin/python bench/bench_demo.py [--json] [--rounds N] [--only 1,2,3,4,5]
(or `make bench`). BENCH_SMOKE=1 (`make bench-smoke`): every section once, on a 4-layer model
and two prompts.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

from pdhal_demo import DEFAULT_PROMPTS, pipeline
from pdhal_demo.model import ModelConfig
from pdhal_demo.plan import make_plan

from pdhal import ops
from pdhal.transfer import block_runs

SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # make bench-smoke: the same runs, tiny sizes
PROMPTS = [64, 128] if SMOKE else [int(n) for n in DEFAULT_PROMPTS.split(",")]
MODEL = ModelConfig(layers=4 if SMOKE else 32)
CACHE_BLOCKS = 64
TARGET = {"overlap": 0.9, "shm": 0.9, "mooncake": 0.9}


def say(text: str = "") -> None:
    print(text, file=sys.stderr if ARGS.json else sys.stdout, flush=True)


def plan_for(transport: str, signal_at_end: bool, batch: int, mode: str = "per_query"):
    return make_plan(
        MODEL,
        PROMPTS,
        mode,
        transport,
        cache_blocks=CACHE_BLOCKS,
        decode_steps=4,
        batch=batch,
        chunk_tokens=512,
        signal_at_end=signal_at_end,
    )


def demo(transport: str, signal_at_end: bool, batch: int = 4, **options) -> dict:
    summary, _ = pipeline.run(
        plan_for(transport, signal_at_end, batch), pipeline.Options(progress=False, **options)
    )
    assert summary["ok"], summary
    assert summary["causality_violations"] == 0, summary
    assert summary["overlap_efficiency_p50"] <= 1 and summary["exposed_ms_p50"] >= 0, summary
    return summary


def standalone(transport: str, **options) -> dict:
    """Every prompt in one step, every layer posted after the forward pass: the messager
    then moves all 32 layers back to back, alone on its core."""
    return demo(transport, signal_at_end=True, batch=len(PROMPTS), **options)


def step_runs(plan) -> list[list[tuple[int, int, int]]]:
    """The runs the messager copies for each layer, per step of a per_query plan."""
    out = []
    for step in plan.steps:
        requests = [plan.request(c.request) for c in step]
        src = [b for r in requests for b in r.prefill_blocks]
        dst = [b for r in requests for b in r.decode_blocks[: len(r.prefill_blocks)]]
        out.append(block_runs(src, dst))
    return out


class Memcpy:
    """memmove of the messager's runs, layer by layer, between two prefaulted (mlocked) host
    buffers shaped like the two caches: what the shm transport does, without the transport."""

    def __init__(self, plan):
        self.steps = step_runs(plan)
        self.block = MODEL.block_bytes()
        self.src_row = plan.prefill_cache_blocks * self.block
        self.dst_row = plan.decode_cache_blocks * self.block
        self.src = ops.host_alloc(2 * MODEL.layers * self.src_row)
        self.dst = ops.host_alloc(2 * MODEL.layers * self.dst_row)
        ctypes.memset(self.src.address, 1, 2 * MODEL.layers * self.src_row)
        self.nbytes = (
            2 * MODEL.layers * sum(n for runs in self.steps for _, _, n in runs) * self.block
        )

    def runs_gib_s(self, gap_s: float = 0.0) -> float:
        """Copy every layer's runs, back to back, or each layer after `gap_s` of sleep (as
        the pipeline's transfers come, one per layer computed); GiB/s of the copying time."""
        memmove, block, src, dst = ctypes.memmove, self.block, self.src.address, self.dst.address
        busy = 0
        for runs in self.steps:
            for layer in range(MODEL.layers):
                if gap_s:
                    time.sleep(gap_s)
                start = time.perf_counter_ns()
                for kv in (0, 1):
                    s = src + (2 * layer + kv) * self.src_row
                    d = dst + (2 * layer + kv) * self.dst_row
                    for a, b, n in runs:
                        memmove(d + b * block, s + a * block, n * block)
                busy += time.perf_counter_ns() - start
        return self.nbytes / (busy / 1e9) / 2**30

    def flat_gib_s(self) -> float:
        """One memmove of the same number of bytes (the upper bound of a copy)."""
        start = time.perf_counter_ns()
        ctypes.memmove(self.dst.address, self.src.address, self.nbytes)
        return self.nbytes / ((time.perf_counter_ns() - start) / 1e9) / 2**30

    def close(self) -> None:
        ops.host_free(self.src)
        ops.host_free(self.dst)


def transfer_engine_bench(
    block_size: int, batch: int, threads: int = 1, seconds: int = 3
) -> float | None:
    """GiB/s of Mooncake's own transfer_engine_bench (write, TCP, loopback), or None."""
    exe = shutil.which("transfer_engine_bench", path=os.path.dirname(sys.executable))
    if exe is None:
        return None
    common = [
        "-metadata_server",
        "P2PHANDSHAKE",
        "-local_server_name",
        "127.0.0.1",
        "-protocol",
        "tcp",
        "-buffer_size",
        str(256 << 20),
    ]
    target = subprocess.Popen(
        [exe, "-mode", "target", *common],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        port = None
        for line in target.stderr:
            if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = m.group(1)
                break
        run = subprocess.run(
            [
                exe,
                "-mode",
                "initiator",
                *common,
                "-segment_id",
                f"127.0.0.1:{port}",
                "-operation",
                "write",
                "-block_size",
                str(block_size),
                "-batch_size",
                str(batch),
                "-threads",
                str(threads),
                "-duration",
                str(seconds),
                "-report_unit",
                "GiB",
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
    finally:
        os.killpg(target.pid, signal.SIGKILL)  # the target leaves a process behind otherwise
        target.wait()
    m = re.search(r"throughput ([\d.]+) GiB/s", run.stderr)
    return float(m.group(1)) if m else None


def stats(values: list[float]) -> dict:
    return {"best": max(values), "median": statistics.median(values), "rounds": values}


def fmt(s: dict) -> str:
    return (
        f"best {s['best']:.2f}, median {s['median']:.2f} GiB/s "
        f"({', '.join(f'{v:.2f}' for v in s['rounds'])})"
    )


def row(label: str, s: dict) -> str:
    return (
        f"  {label:34s} TTFT mean {s['ttft_ms']['mean']:5.0f} ms, after prefill "
        f"{s['ttft_after_prefill_ms']['mean']:6.1f} ms | exposed transfer p50 "
        f"{s['exposed_ms_p50']:6.2f} ms | overlap efficiency p50 "
        f"{s['overlap_efficiency_p50']:.3f}"
    )


def brief(s: dict) -> dict:
    keep = (
        "transport",
        "layer_signals",
        "bytes_moved",
        "transfer_throughput_gib_s",
        "compute_s",
        "wall_s",
        "ttft_ms",
        "ttft_after_prefill_ms",
        "exposed_ms_p50",
        "exposed_ms_p99",
        "overlap_efficiency_p50",
        "overlap_efficiency_p1",
        "causality_violations",
    )
    return {k: s[k] for k in keep}


def section_ttft(out: dict) -> None:
    say(
        "\n1. layer-wise streaming vs all layers after the forward pass (per_query, 4 prompts "
        "per step)"
    )
    result = {}
    for transport in ("shm", "mooncake"):
        rounds = {"layer-wise": [], "at-end": []}
        for _ in range(ARGS.rounds_ttft):  # interleaved
            rounds["layer-wise"].append(demo(transport, signal_at_end=False))
            rounds["at-end"].append(demo(transport, signal_at_end=True))
        runs = {}
        for how, summaries in rounds.items():
            median = lambda key, sub=None: statistics.median(  # noqa: E731
                s[key][sub] if sub else s[key] for s in summaries
            )
            runs[how] = {
                "ttft_ms_mean": median("ttft_ms", "mean"),
                "ttft_after_prefill_ms_mean": median("ttft_after_prefill_ms", "mean"),
                "exposed_ms_p50": median("exposed_ms_p50"),
                "overlap_efficiency_p50": median("overlap_efficiency_p50"),
                "transfer_throughput_gib_s": median("transfer_throughput_gib_s"),
                "runs": [brief(s) for s in summaries],
            }
            for s in summaries:
                when = "signal per layer" if how == "layer-wise" else "all after the forward pass"
                say(row(f"{transport}, {when}", s))
        lw, ae = runs["layer-wise"], runs["at-end"]
        runs["ttft_after_prefill_at_end_over_layerwise"] = (
            ae["ttft_after_prefill_ms_mean"] / lw["ttft_after_prefill_ms_mean"]
        )
        runs["meets_overlap_target"] = lw["overlap_efficiency_p50"] >= TARGET["overlap"]
        say(
            f"  -> {transport} (medians): TTFT after prefill "
            f"{lw['ttft_after_prefill_ms_mean']:.1f} ms layer-wise vs "
            f"{ae['ttft_after_prefill_ms_mean']:.1f} ms at end "
            f"({runs['ttft_after_prefill_at_end_over_layerwise']:.1f}x); exposed transfer p50 "
            f"{lw['exposed_ms_p50']:.2f} vs {ae['exposed_ms_p50']:.2f} ms; overlap "
            f"efficiency p50 {lw['overlap_efficiency_p50']:.3f} vs "
            f"{ae['overlap_efficiency_p50']:.3f} "
            f"({'meets' if runs['meets_overlap_target'] else 'MISSES'} >= {TARGET['overlap']})"
        )
        result[transport] = runs
    out["ttft"] = result


def section_shm(out: dict) -> None:
    say(f"\n2. shm transport vs memcpy of the same block runs ({ARGS.rounds} interleaved rounds)")
    alone = Memcpy(plan_for("shm", True, len(PROMPTS)))
    spaced = Memcpy(plan_for("shm", False, 4))
    rounds = {
        k: []
        for k in (
            "memcpy_runs",
            "memcpy_flat",
            "memcpy_runs_spaced",
            "shm_memmove",
            "shm_with_compute",
        )
    }
    try:
        for _ in range(ARGS.rounds):
            rounds["memcpy_runs"].append(alone.runs_gib_s())
            rounds["memcpy_flat"].append(alone.flat_gib_s())
            rounds["shm_memmove"].append(standalone("shm")["transfer_throughput_gib_s"])
            pipelined = demo("shm", signal_at_end=False)
            rounds["shm_with_compute"].append(pipelined["transfer_throughput_gib_s"])
            # the same runs, each layer's after the time a layer takes to compute
            gap = pipelined["compute_s"] / (MODEL.layers * len(spaced.steps))
            rounds["memcpy_runs_spaced"].append(spaced.runs_gib_s(gap))
    finally:
        alone.close()
        spaced.close()
    r = {"bytes": alone.nbytes, "runs_per_layer": 2 * len(alone.steps[0])}
    r |= {key: stats(values) for key, values in rounds.items()}
    for key, reference in (
        ("shm_memmove", "memcpy_runs"),
        ("shm_with_compute", "memcpy_runs"),
        ("shm_with_compute_vs_spaced", "memcpy_runs_spaced"),
    ):
        mine = r[key.removesuffix("_vs_spaced")]
        r[f"{key}_ratio"] = {
            "median": mine["median"] / r[reference]["median"],
            "best": mine["best"] / r[reference]["best"],
        }
    r["meets_target"] = r["shm_memmove_ratio"]["median"] >= TARGET["shm"]
    say(
        f"  memcpy of the runs ({r['runs_per_layer']} per layer, {alone.nbytes / 2**20:.0f} "
        f"MiB), back to back:     {fmt(r['memcpy_runs'])}"
    )
    say(f"  one flat memcpy of as many bytes:               {fmt(r['memcpy_flat'])}")
    say(f"  memcpy of the pipeline's runs, a layer's time apart: {fmt(r['memcpy_runs_spaced'])}")
    for key, label in (
        ("shm_memmove", "shm, memmove per run, standalone"),
        ("shm_with_compute", "shm, memmove, the model computing"),
    ):
        ratio = r[f"{key}_ratio"]
        say(
            f"  {label:47s} {fmt(r[key])} -> {ratio['median']:.2f}x median, "
            f"{ratio['best']:.2f}x best"
        )
    ratio = r["shm_with_compute_vs_spaced_ratio"]
    say(
        f"  -> shm standalone {r['shm_memmove_ratio']['median']:.2f}x memcpy of the same runs "
        f"({'meets' if r['meets_target'] else 'MISSES'} >= {TARGET['shm']}x); with the model "
        f"computing {r['shm_with_compute_ratio']['median']:.2f}x of it, "
        f"{ratio['median']:.2f}x of the same runs copied a layer's time apart"
    )
    out["shm"] = r


def section_mooncake(out: dict) -> None:
    say(
        f"\n3. Mooncake (TCP, loopback) vs Mooncake's transfer_engine_bench ({ARGS.rounds} "
        f"interleaved rounds)"
    )
    plan = plan_for("mooncake", True, len(PROMPTS))
    [runs] = step_runs(plan)
    block = max(n for _, _, n in runs) * MODEL.block_bytes()
    per_layer, inflight = 2 * len(runs), pipeline.Options().inflight
    batches = {"one layer": per_layer, "as many as the demo keeps in flight": per_layer * inflight}
    rounds = {"demo": [], "demo_one_layer_at_a_time": [], "with_compute": []}
    rounds |= {f"teb_batch_{b}": [] for b in batches.values()}
    for _ in range(ARGS.rounds):
        rounds["demo"].append(standalone("mooncake")["transfer_throughput_gib_s"])
        rounds["demo_one_layer_at_a_time"].append(
            standalone("mooncake", inflight=1)["transfer_throughput_gib_s"]
        )
        rounds["with_compute"].append(
            demo("mooncake", signal_at_end=False)["transfer_throughput_gib_s"]
        )
        for b in batches.values():
            reference = transfer_engine_bench(block, b, seconds=1 if SMOKE else 3)
            if reference is None:
                say("  transfer_engine_bench did not run (not installed with Mooncake's wheel?)")
                out["mooncake"] = {k: stats(v) for k, v in rounds.items() if v}
                return
            rounds[f"teb_batch_{b}"].append(reference)
    r = {
        "block_bytes": block,
        "runs_per_layer": per_layer,
        "inflight_layers": inflight,
        "threads": 1,
    } | {k: stats(v) for k, v in rounds.items()}
    best_teb = max((f"teb_batch_{b}" for b in batches.values()), key=lambda k: r[k]["median"])
    r["reference"] = best_teb
    for key in ("demo", "demo_one_layer_at_a_time", "with_compute"):
        r[f"{key}_ratio"] = {
            "median": r[key]["median"] / r[best_teb]["median"],
            "best": r[key]["best"] / r[best_teb]["best"],
        }
    r["meets_target"] = r["demo_ratio"]["median"] >= TARGET["mooncake"]
    for name, b in batches.items():
        say(f"  transfer_engine_bench, batch {b:2d} ({name}): {fmt(r[f'teb_batch_{b}'])}")
    for key, label in (
        ("demo", f"demo, standalone, {inflight} layers in flight"),
        ("demo_one_layer_at_a_time", "demo, standalone, one layer at a time"),
        ("with_compute", "demo, the model computing"),
    ):
        say(
            f"  {label:46s} {fmt(r[key])} -> {r[f'{key}_ratio']['median']:.2f}x median, "
            f"{r[f'{key}_ratio']['best']:.2f}x best"
        )
    say(
        f"  -> Mooncake in the demo {r['demo_ratio']['median']:.2f}x transfer_engine_bench "
        f"(block {block} B, the better batch, 1 thread) "
        f"({'meets' if r['meets_target'] else 'MISSES'} >= {TARGET['mooncake']}x)"
    )
    out["mooncake"] = r


def section_tp(out: dict) -> None:
    say(
        "\n4. tensor parallelism, 2 ranks: rank 1's link made slow (each layer's transfer "
        "waits 50 ms) against none"
    )
    r = {}
    for label, slow in (("no slow rank", {}), ("rank 1 slow", {1: 50.0})):
        plan = make_plan(
            MODEL,
            PROMPTS,
            "per_query",
            "shm",
            cache_blocks=CACHE_BLOCKS,
            decode_steps=4,
            batch=4,
            chunk_tokens=512,
            tp=2,
        )
        summary, _ = pipeline.run(plan, pipeline.Options(progress=False, slow_ms=slow))
        assert summary["ok"], summary
        r[label] = {"ttft_ms_mean": summary["ttft_ms"]["mean"], "ranks": summary["ranks"]}
        for rank in summary["ranks"]:
            say(
                f"  {label:13s} rank {rank['rank']} (device {rank['device']}): exposed transfer "
                f"p99 {rank['exposed_ms_p99']:7.1f} ms, longest wait before a transfer "
                f"{rank['max_start_lag_ms']:7.1f} ms, {rank['transfer_throughput_gib_s']:.2f} "
                f"GiB/s while in flight"
            )
    out["tp"] = r


def section_many(out: dict) -> None:
    requests = 40 if SMOKE else 150  # throughput_windows needs 20
    say(
        f"\n5. many requests: {requests} through 16-block caches and 4 batch slots (per_chunk, "
        f"128-token steps, 4 layers, shm): requests/s and GiB/s by tenths of the run"
    )
    model = ModelConfig(layers=4)
    prompts = [[64, 100, 200, 333][i % 4] for i in range(requests)]
    plan = make_plan(
        model,
        prompts,
        "per_chunk",
        "shm",
        cache_blocks=16,
        decode_steps=3,
        batch=2,
        chunk_tokens=128,
        max_batch=4,
    )
    summary, _ = pipeline.run(plan, pipeline.Options(progress=False))
    assert summary["ok"] and summary["recycled_blocks"], summary
    windows = summary["throughput_windows"]
    say(
        f"  {summary['steps']} steps (the ring holds 16), "
        f"{summary['bytes_moved'] / 2**20:.0f} MiB moved"
    )
    say("  requests/s: " + ", ".join(f"{w['requests_per_s']:.1f}" for w in windows))
    say("  GiB moved per second of the run: " + ", ".join(f"{w['gib_s']:.3f}" for w in windows))
    rates = [w["requests_per_s"] for w in windows]
    flat = sum(rates[-3:]) / sum(rates[1:4])
    say(f"  -> last three tenths / tenths 2-4: {flat:.2f}")
    out["many_requests"] = {
        "requests": requests,
        "steps": summary["steps"],
        "windows": windows,
        "last_over_early": flat,
    }


SECTIONS = {
    "1": section_ttft,
    "2": section_shm,
    "3": section_mooncake,
    "4": section_tp,
    "5": section_many,
}


def main() -> None:
    os.environ.setdefault("PDHAL_NAMESPACE", f"bench{os.getpid()}")
    out = {
        "model": {
            "layers": MODEL.layers,
            "prompts": PROMPTS,
            "cache_blocks": CACHE_BLOCKS,
            "block_bytes": MODEL.block_bytes(),
        },
        "rounds": ARGS.rounds,
    }
    say(
        f"model: {MODEL.layers} layers, prompts {PROMPTS}, blocks of "
        f"{MODEL.block_bytes() // 1024} KiB per layer and K/V"
    )
    for key in ARGS.only.split(","):
        SECTIONS[key](out)
    if ARGS.json:
        print(json.dumps(out, indent=2))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON (the human lines go to stderr)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1 if SMOKE else 5, help="interleaved rounds (2, 3)"
    )
    parser.add_argument(
        "--rounds-ttft", type=int, default=1 if SMOKE else 3, help="interleaved rounds (1)"
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections to run, e.g. 2,3")
    return parser.parse_args(argv)


ARGS = parse([])  # replaced in __main__

if __name__ == "__main__":
    ARGS = parse()
    main()
