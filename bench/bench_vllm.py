"""Time to first token on the decode side after prefill ends: the pdhal connector (each layer
shipped by the messager while the next computes) against vLLM's ExampleConnector (each layer
saved to a file inside the forward pass, all layers loaded by the decode's first forward),
side by side in one run, on vLLM's CPU build with a tiny local Llama.

    .venv-vllm/bin/python bench/bench_vllm.py [--rounds 2] [--layers 8] [--prompt-len 1000]

Per request: prefill end = the prefill instance's step that finished it (its forward pass
and the sampled token); first token = the decode instance's step that produced its first
token. "after prefill" is the difference; "exposed transfer" is that minus one decode step
(the median interval between the decode's later tokens), the part of the transfer that
compute did not hide. In the pdhal mode the decode instance asks for the KV before the
prefill starts (as a router sends both at once); in the example mode it can only submit once
the files exist, so it waits for the prefill's end (polled every millisecond). On a shared
2-core machine the absolute numbers mean little: read the ratio.

BENCH_SMOKE=1 (`BENCH_SMOKE=1 make bench-vllm`): by default one round of two 100-token
prompts, the same runs; its time is mostly the four vLLM instances starting.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

PY = sys.executable
SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # BENCH_SMOKE=1 make bench-vllm: the same runs, small


def prompts(count: int, length: int, seed: int) -> list[dict]:
    return [
        {
            "tid": f"b{seed}-{i}",
            "tokens": [(11 * i + 5 * j + seed) % 990 + 2 for j in range(length)],
        }
        for i in range(count)
    ]


def run_pair(mode: str, model: str, items: list[dict], root: str, max_tokens: int) -> dict:
    env = dict(
        os.environ,
        PDHAL_VLLM_KEY=secrets.token_hex(16),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        PDHAL_NAMESPACE=f"bench{os.getpid()}{mode}",
    )
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "prompts.json")
    with open(path, "w") as f:
        json.dump(items, f)
    procs, logs = [], []

    def start(args, name):
        log = open(os.path.join(root, f"{name}.log"), "w")
        logs.append(log)
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    common = [
        "--model",
        model,
        "--prompts",
        path,
        "--max-tokens",
        str(max_tokens),
        "--timeout",
        "600",
        "--wait-timeout",
        "600",
        "--poll",
        "0.001",
        "--max-model-len",
        "2048",
    ]
    trace = os.path.join(root, "trace")
    try:
        if mode == "pdhal":
            messager = subprocess.Popen(
                [
                    PY,
                    "-u",
                    "-m",
                    "pdhal_vllm.messager",
                    "--listen",
                    "127.0.0.1:0",
                    "--trace",
                    trace + ".messager.jsonl",
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(messager)
            address = messager.stdout.readline().split()[-1]
            extra = ["--messager", address, "--trace", trace]
            decode = start(
                [
                    PY,
                    "-m",
                    "pdhal_vllm.instance",
                    "decode",
                    *common,
                    *extra,
                    "--out",
                    os.path.join(root, "decode.json"),
                    "--submitted-file",
                    os.path.join(root, "decode.submitted"),
                ],
                "decode",
            )
            prefill = start(
                [
                    PY,
                    "-m",
                    "pdhal_vllm.instance",
                    "prefill",
                    *common,
                    *extra,
                    "--out",
                    os.path.join(root, "prefill.json"),
                    "--wait-file",
                    os.path.join(root, "decode.submitted"),
                ],
                "prefill",
            )
        else:
            storage = os.path.join(root, "kv-files")
            extra = ["--connector", "example", "--storage", storage]
            prefill = start(
                [
                    PY,
                    "-m",
                    "pdhal_vllm.instance",
                    "prefill",
                    *common,
                    *extra,
                    "--out",
                    os.path.join(root, "prefill.json"),
                    "--finished-file",
                    os.path.join(root, "prefill.finished"),
                    "--wait-file",
                    os.path.join(root, "decode.ready"),
                ],
                "prefill",
            )
            decode = start(
                [
                    PY,
                    "-m",
                    "pdhal_vllm.instance",
                    "decode",
                    *common,
                    *extra,
                    "--out",
                    os.path.join(root, "decode.json"),
                    "--ready-file",
                    os.path.join(root, "decode.ready"),
                    "--wait-file",
                    os.path.join(root, "prefill.finished"),
                ],
                "decode",
            )
        for proc, name in ((decode, "decode"), (prefill, "prefill")):
            if proc.wait(900) != 0:
                with open(os.path.join(root, f"{name}.log"), errors="replace") as f:
                    sys.exit(f"{mode}: the {name} instance failed:\n{f.read()[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        for log in logs:
            log.close()
    with open(os.path.join(root, "prefill.json")) as f:
        prefill_out = {r["tid"]: r for r in json.load(f)["results"]}
    with open(os.path.join(root, "decode.json")) as f:
        decode_out = {r["tid"]: r for r in json.load(f)["results"]}
    after, exposed, tokens = [], [], {}
    for tid, d in decode_out.items():
        end = prefill_out[tid]["finished_ns"]
        step = (d["finished_ns"] - d["first_token_ns"]) / max(1, max_tokens - 1)
        after.append((d["first_token_ns"] - end) / 1e6)
        exposed.append((d["first_token_ns"] - end - step) / 1e6)
        tokens[tid] = d["tokens"]
    overlap = None
    if mode == "pdhal":
        from pdhal_vllm.wire import read_trace

        signals = [e for e in read_trace(trace + ".prefill0.jsonl") if e["kind"] == "signal"]
        landed = [e for e in read_trace(trace + ".messager.jsonl") if e["kind"] == "landed"]
        if signals and landed:  # the last layer's landing after the forward's last signal
            overlap = (max(e["t"] for e in landed) - max(e["t"] for e in signals)) / 1e6
    return {
        "after_ms": statistics.median(after),
        "exposed_ms": statistics.median(exposed),
        "tail_ms": overlap,
        "tokens": tokens,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=1 if SMOKE else 2, help="pairs of runs, interleaved"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2 if SMOKE else 4)
    parser.add_argument("--prompt-len", type=int, default=100 if SMOKE else 1000)
    parser.add_argument("--max-tokens", type=int, default=3 if SMOKE else 6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from pdhal_vllm import tiny

    cache = os.environ.get("PDHAL_VLLM_CACHE") or os.path.join(
        tempfile.gettempdir(), "pdhal-vllm-models"
    )
    model = tiny.cached(cache, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=4)
    rows = {"pdhal": [], "example": []}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        for r in range(args.rounds):
            for mode in ("pdhal", "example"):
                items = prompts(args.prompts, args.prompt_len, seed=r)
                t = time.monotonic()
                row = run_pair(mode, model, items, os.path.join(tmp, f"{mode}{r}"), args.max_tokens)
                row["wall_s"] = time.monotonic() - t
                rows[mode].append(row)
                print(
                    f"round {r} {mode:8s} after prefill {row['after_ms']:8.2f} ms   exposed "
                    f"transfer {row['exposed_ms']:8.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
            if rows["pdhal"][-1]["tokens"] != rows["example"][-1]["tokens"]:
                sys.exit("the two connectors decoded different tokens")
    summary = {}
    for mode, runs in rows.items():
        summary[mode] = {
            k: statistics.median(x[k] for x in runs) for k in ("after_ms", "exposed_ms")
        }
    tails = [x["tail_ms"] for x in rows["pdhal"] if x["tail_ms"] is not None]
    summary["pdhal"]["last_layer_after_forward_ms"] = statistics.median(tails) if tails else None
    summary["ratio_after"] = summary["example"]["after_ms"] / summary["pdhal"]["after_ms"]
    summary["setup"] = {
        "layers": args.layers,
        "hidden": args.hidden,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "rounds": args.rounds,
        "kv_bytes_per_request": args.layers * args.prompt_len * 2 * args.hidden * 2,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"decode TTFT after prefill ends ({args.prompts} x {args.prompt_len} tokens, "
        f"{args.layers} layers, median of {args.rounds} rounds):"
    )
    print(f"  {'connector':24s} {'after prefill':>14s} {'exposed transfer':>17s}")
    for mode, label in (("pdhal", "pdhal (layer-wise)"), ("example", "example (after fwd)")):
        s = summary[mode]
        print(f"  {label:24s} {s['after_ms']:11.2f} ms {s['exposed_ms']:14.2f} ms")
    if summary["pdhal"]["after_ms"] > 0:
        print(f"  ratio example / pdhal: {summary['ratio_after']:.2f}x")
    else:  # the decode's first token came before the prefill instance returned its own
        print(
            "  pdhal: the decode's first token came before the prefill instance returned "
            "its output: no ratio (the transfer is hidden behind the prefill's own tail)"
        )
    tail = summary["pdhal"]["last_layer_after_forward_ms"]
    if tail is not None:
        print(f"  pdhal: the last layer landed {tail:.2f} ms after the forward's last signal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
