"""The `pdhal demo` command, found by `pdhal` through the `pdhal.commands` entry-point group.

`add_arguments(parser)` fills the subcommand's parser and imports nothing heavy (`pdhal
--help` builds it); `main(args)` runs the demo and returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdhal_demo import DEFAULT_PROMPTS, MODES, TRANSPORTS

HELP = "prefill worker -> cache messager -> decode, layer by layer"  # `pdhal --help`


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _slow_rank(text: str) -> dict[int, float]:
    rank, _, ms = text.partition(":")
    try:
        return {int(rank): float(ms)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:MS, got {text!r}") from None


def _prompt_lens(text: str) -> list[int]:
    import pdhal  # a per_chunk step table holds at most pdhal.MAX_REQUESTS requests

    try:
        lens = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not 1 <= len(lens) <= pdhal.MAX_REQUESTS:
        raise argparse.ArgumentTypeError(
            f"expected 1 to {pdhal.MAX_REQUESTS} prompts, got {len(lens)}")
    return lens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--transport", choices=TRANSPORTS, default="shm")
    parser.add_argument("--layers", type=_positive, default=32)
    parser.add_argument("--prompt-lens", type=_prompt_lens, default=DEFAULT_PROMPTS,
                        help="comma-separated prompt lengths, one request each")
    parser.add_argument("--requests", type=_positive,
                        help="run this many requests, the prompt lengths taken in turn "
                             "(blocks and batch slots are recycled as requests finish)")
    parser.add_argument("--cache-blocks", type=_positive, default=64,
                        help="blocks of 64 tokens in each side's KV cache")
    parser.add_argument("--max-batch", type=_positive, default=64,
                        help="per_chunk: batch slots of a step table (requests in flight)")
    parser.add_argument("--batch", type=_positive, default=4, help="per_query: prompts per step")
    parser.add_argument("--chunk-tokens", type=_positive, default=512,
                        help="per_chunk: tokens per step (long prompts are split)")
    parser.add_argument("--decode-steps", type=_positive, default=4)
    parser.add_argument("--signal-at-end", action="store_true",
                        help="baseline: post every layer signal only after the forward pass")
    parser.add_argument("--shm-copy", choices=["memmove", "copy_blocks"], default="memmove",
                        help="shm: a memmove per run of blocks, or one pdhal.ops.copy_blocks "
                             "per layer")
    parser.add_argument("--inflight", type=_positive, default=4,
                        help="Mooncake: layers whose transfers may be in flight at once")
    parser.add_argument("--transfer-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="Mooncake: report a transfer not complete after this (plus "
                             "100 MiB/s for its bytes): the link or the decode side is gone")
    parser.add_argument("--tp", type=_positive, default=1,
                        help="tensor-parallel ranks: a worker (its share of the heads) and a "
                             "messager each, on its own device and channels; one decoder")
    parser.add_argument("--slow-rank", type=_slow_rank, default={}, metavar="RANK:MS",
                        help="make rank RANK's link slow: each layer's transfer waits MS ms")
    parser.add_argument("--host", default="127.0.0.1", help="Mooncake: this host's address")
    parser.add_argument("--decoder", choices=["local", "remote"], default="local",
                        help="remote: start no decoder, print the command that starts one on "
                             "the decode host and wait for it (Mooncake only)")
    parser.add_argument("--control-host", default="127.0.0.1",
                        help="address the control listener binds (0.0.0.0 for a remote "
                             "decoder; it only admits processes holding its random key)")
    parser.add_argument("--protocol", default="tcp", help="Mooncake: tcp, or rdma on a cluster")
    parser.add_argument("--fault", choices=["kill-messager", "kill-worker", "kill-decoder"],
                        help="show fault handling: SIGKILL that process mid-step")
    parser.add_argument("--plot", metavar="FILE.png", help="timeline of compute and transfer")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")


def main(args) -> int:
    from pdhal_demo import pipeline, report
    from pdhal_demo.control import DemoError
    from pdhal_demo.model import ModelConfig
    from pdhal_demo.plan import make_plan

    model = ModelConfig(layers=args.layers)
    try:
        model.check_tp(args.tp)
    except ValueError as exc:
        print(f"pdhal demo: {exc}", file=sys.stderr)
        return 2
    import pdhal

    if args.max_batch > pdhal.MAX_REQUESTS:
        print(f"pdhal demo: --max-batch is at most {pdhal.MAX_REQUESTS}", file=sys.stderr)
        return 2
    prompt_lens = args.prompt_lens
    if args.requests:
        prompt_lens = [prompt_lens[i % len(prompt_lens)] for i in range(args.requests)]
    if any(rank >= args.tp for rank in args.slow_rank):
        print(f"pdhal demo: --slow-rank names a rank beyond --tp {args.tp}", file=sys.stderr)
        return 2
    if args.fault == "kill-decoder" and args.decoder == "remote":
        print("pdhal demo: --fault kill-decoder kills a local decoder; kill a remote one by hand",
              file=sys.stderr)
        return 2
    if args.decoder == "remote" and args.transport != "mooncake":
        print("pdhal demo: --decoder remote needs --transport mooncake (shm stays on one host)",
              file=sys.stderr)
        return 2
    options = pipeline.Options(host=args.host, protocol=args.protocol, fault=args.fault,
                               progress=not args.json, remote_decoder=args.decoder == "remote",
                               control_host=args.control_host, shm_copy=args.shm_copy,
                               inflight=args.inflight,
                               transfer_timeout_s=args.transfer_timeout,
                               slow_ms=args.slow_rank)
    summaries, timelines = [], []
    try:
        for mode in MODES if args.mode == "both" else [args.mode]:
            plan = make_plan(model, prompt_lens, mode, args.transport, args.cache_blocks,
                             args.decode_steps, args.batch, args.chunk_tokens,
                             args.signal_at_end, args.tp, args.max_batch)
            for length, why in plan.rejected:
                print(f"pdhal demo: rejected a {length}-token prompt up front: {why}",
                      file=sys.stderr)
            if not args.json:
                print(f"pdhal demo: {mode}, {len(plan.requests)} requests, {model.layers} "
                      f"layers, {len(plan.steps)} steps, transport {args.transport}"
                      + (f", {args.tp} tensor-parallel ranks" if args.tp > 1 else ""),
                      file=sys.stderr)
            summary, timeline = pipeline.run(plan, options)
            summaries.append(summary)
            timelines.append((f"{mode} over {args.transport}", timeline))
            if not args.json:
                print(report.format_summary(summary), flush=True)
        if args.plot:
            report.plot(timelines, args.plot)
    except DemoError as exc:
        print(f"pdhal demo: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summaries, indent=2))
    return 0 if all(s["ok"] for s in summaries) else 1
