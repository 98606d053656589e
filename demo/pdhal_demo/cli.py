"""The `pdhal demo` command, found by `pdhal` through the `pdhal.commands` entry-point group.

`add_arguments(parser)` fills the subcommand's parser and imports nothing heavy (`pdhal
--help` builds it); `main(args)` runs the demo and returns the exit status.

Before any process starts, `main` checks what the run needs: the options, the --plot path
(its folder exists and takes a file, matplotlib is there and writes its format), the PDHAL_*
variables the processes inherit (pdhal.check_environment(), the decoder's with
--decode-platform's backend), Paddle, and Mooncake for --transport mooncake. A failed
check is one line, `pdhal: error: ...`, saying what to do; exit status 2 for a usage error,
1 for the environment.

`--json` prints one JSON object on stdout (report.to_json): {"pdhal_version", "backend",
"schema_version", "runs": [one summary per mode run, report.summarize]}; the processes'
own output goes to their logs, never to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdhal.plugin import Command, hookimpl
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
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not 1 <= len(lens) <= pdhal.MAX_REQUESTS:
        raise argparse.ArgumentTypeError(
            f"expected 1 to {pdhal.MAX_REQUESTS} prompts, got {len(lens)}"
        )
    return lens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--transport", choices=TRANSPORTS, default="shm")
    parser.add_argument("--layers", type=_positive, default=32)
    parser.add_argument(
        "--prompt-lens",
        type=_prompt_lens,
        default=DEFAULT_PROMPTS,
        help="comma-separated prompt lengths, one request each",
    )
    parser.add_argument(
        "--requests",
        type=_positive,
        help="run this many requests, the prompt lengths taken in turn "
        "(blocks and batch slots are recycled as requests finish)",
    )
    parser.add_argument(
        "--cache-blocks",
        type=_positive,
        default=64,
        help="blocks of 64 tokens in each side's KV cache",
    )
    parser.add_argument(
        "--max-batch",
        type=_positive,
        default=64,
        help="per_chunk: batch slots of a step table (requests in flight)",
    )
    parser.add_argument("--batch", type=_positive, default=4, help="per_query: prompts per step")
    parser.add_argument(
        "--chunk-tokens",
        type=_positive,
        default=512,
        help="per_chunk: tokens per step (long prompts are split)",
    )
    parser.add_argument("--decode-steps", type=_positive, default=4)
    parser.add_argument(
        "--decode-block-size",
        type=_positive,
        metavar="TOKENS",
        help="tokens of a decode cache block (default: the prefill's 64): each token "
        "goes where the decode side's blocks hold it",
    )
    parser.add_argument(
        "--decode-order",
        choices=["heads", "tokens"],
        help="how a decode cache block is ordered: heads (each head's tokens, HND: the "
        "prefill's) or tokens (each token's heads, NHD), converted on the way",
    )
    parser.add_argument(
        "--decode-platform",
        metavar="BACKEND",
        help="run the decoder on this pdhal backend (PDHAL_PLATFORM there; default: the "
        "prefill's), its cache in that backend's pinned host memory",
    )
    parser.add_argument(
        "--signal-at-end",
        action="store_true",
        help="baseline: post every layer signal only after the forward pass",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="per_query over shm: hand each step to the messager's service once "
        "(PrefillService.follow); the link starts each layer's copies at its signal, "
        "with no call per layer",
    )
    parser.add_argument(
        "--inflight",
        type=_positive,
        default=4,
        help="layers whose transfers may be in flight at once",
    )
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="fail a layer's transfer not landed after this: the link or the decode "
        "side is gone or stalled",
    )
    parser.add_argument(
        "--tp",
        type=_positive,
        default=1,
        help="tensor-parallel ranks: a worker (its share of the heads) and a "
        "messager each, on its own device and channels; one decoder",
    )
    parser.add_argument(
        "--slow-rank",
        type=_slow_rank,
        default={},
        metavar="RANK:MS",
        help="make rank RANK's link slow: each layer's transfer waits MS ms, in line",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Mooncake: this host's address")
    parser.add_argument(
        "--decoder",
        choices=["local", "remote"],
        default="local",
        help="remote: start no decoder, print the command that starts one on "
        "the decode host and wait for it (Mooncake only)",
    )
    parser.add_argument(
        "--control-host",
        default="127.0.0.1",
        help="address the control listener binds (0.0.0.0 for a remote "
        "decoder; it only admits processes holding its random key)",
    )
    parser.add_argument("--protocol", default="tcp", help="Mooncake: tcp, or rdma on a cluster")
    parser.add_argument(
        "--fault",
        choices=["kill-messager", "kill-worker", "kill-decoder"],
        help="show fault handling: SIGKILL that process mid-step",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the timeline of compute, signals and transfers (any format "
        "matplotlib writes: .png, .pdf, .svg, ...)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: {pdhal_version, backend, schema_version, "
        "runs: [one summary per mode]}",
    )


class _Refused(Exception):
    """A check before the run failed: one line, and the exit status (2 usage, 1 environment)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _check_usage(args, model) -> None:
    import pdhal

    try:
        model.check_tp(args.tp)
    except ValueError as exc:
        raise _Refused(2, str(exc)) from None
    if args.max_batch > pdhal.MAX_REQUESTS:
        raise _Refused(2, f"--max-batch is at most {pdhal.MAX_REQUESTS}")
    if any(rank >= args.tp for rank in args.slow_rank):
        raise _Refused(2, f"--slow-rank names a rank beyond --tp {args.tp}")
    if args.fault == "kill-decoder" and args.decoder == "remote":
        raise _Refused(2, "--fault kill-decoder kills a local decoder; kill a remote one by hand")
    if args.follow and (args.mode != "per_query" or args.transport != "shm" or args.slow_rank):
        raise _Refused(
            2,
            "--follow needs --mode per_query and --transport shm (a link that waits for "
            "each layer's signal itself), and no --slow-rank (its delay is per layer call)",
        )
    if args.decoder == "remote" and args.transport != "mooncake":
        raise _Refused(2, "--decoder remote needs --transport mooncake (shm stays on one host)")


def _check_plot(path: str) -> None:
    """--plot PATH: a file matplotlib can write, in a folder this process can write in."""
    import os
    import tempfile

    if os.path.isdir(path):
        raise _Refused(
            2,
            f"--plot {path} is a folder: give a file name, such as "
            f"{os.path.join(path, 'demo-timeline.png')}",
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise _Refused(
            2, f"--plot {path}: {folder} {what}; create it, or give a path in an existing folder"
        )
    try:  # as the plot will be written (access() would say yes to root on a read-only mount)
        with tempfile.TemporaryFile(dir=folder, prefix=".pdhal-demo-plot-"):
            pass
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is read-only")
    except OSError as exc:
        raise _Refused(
            2,
            f"--plot {path}: cannot create a file in {folder} "
            f"({exc.strerror or exc}); give a path in a folder you can write "
            f"to",
        ) from None
    try:
        from pdhal_demo.report import plot_formats

        formats = plot_formats()
    except ImportError as exc:
        raise _Refused(
            1,
            f"--plot needs matplotlib, which cannot be imported ({exc}): "
            f"pip install matplotlib, or leave out --plot",
        ) from None
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        common = ["png", "pdf", "svg"]
        said = (
            f"matplotlib cannot write '.{extension}' files"
            if extension
            else "the file name has no extension to say the format"
        )
        raise _Refused(
            2,
            f"--plot {path}: {said}; end the name in .png, .pdf or .svg "
            f"(matplotlib also writes "
            f"{', '.join('.' + f for f in formats if f not in common)})",
        )


def _check_environment(args) -> None:
    """What the processes will need, checked here, before any of them starts."""
    import importlib.util
    import os

    import pdhal

    try:
        pdhal.check_environment()  # the PDHAL_* variables every child inherits
    except pdhal.PdhalError as exc:
        raise _Refused(
            1,
            f"{exc}; fix or unset it (`pdhal info` lists every PDHAL_* variable and what it means)",
        ) from None
    if importlib.util.find_spec("paddle") is None:  # imported by the worker and the decoder
        raise _Refused(
            1,
            "the demo's prefill worker and decode receiver run a Paddle model, "
            "and Paddle is not installed: pip install paddlepaddle (or pip "
            "install -e demo, which pulls it in)",
        )
    if args.decode_platform is not None:
        decoder = dict(os.environ, PDHAL_PLATFORM=args.decode_platform)
        try:
            pdhal.check_environment(decoder)
        except pdhal.PdhalError as exc:
            raise _Refused(1, f"--decode-platform {args.decode_platform}: {exc}") from None
    if args.transport == "mooncake":
        from pdhal_demo.control import DemoError, require_mooncake

        try:
            require_mooncake()
        except DemoError as exc:
            raise _Refused(1, str(exc)) from None


def main(args) -> int:
    """Check everything the run needs (usage, --plot, PDHAL_* variables, Paddle, Mooncake)
    before any process starts, then run each mode; a failed check is one line on stderr,
    `pdhal: error: ...`, exit status 2 for a usage error and 1 for the environment."""
    from pdhal_demo.model import ModelConfig

    model = ModelConfig(layers=args.layers)
    try:
        _check_usage(args, model)
        if args.plot:
            _check_plot(args.plot)
        _check_environment(args)
    except _Refused as exc:
        print(f"pdhal: error: {exc}", file=sys.stderr)
        return exc.status

    from pdhal_demo import pipeline, report
    from pdhal_demo.control import DemoError
    from pdhal_demo.plan import make_plan

    prompt_lens = args.prompt_lens
    if args.requests:
        prompt_lens = [prompt_lens[i % len(prompt_lens)] for i in range(args.requests)]
    options = pipeline.Options(
        host=args.host,
        protocol=args.protocol,
        fault=args.fault,
        progress=not args.json,
        remote_decoder=args.decoder == "remote",
        control_host=args.control_host,
        inflight=args.inflight,
        transfer_timeout_s=args.transfer_timeout,
        slow_ms=args.slow_rank,
        decode_platform=args.decode_platform,
        follow=args.follow,
    )
    summaries, runs = [], []
    try:
        for mode in MODES if args.mode == "both" else [args.mode]:
            plan = make_plan(
                model,
                prompt_lens,
                mode,
                args.transport,
                args.cache_blocks,
                args.decode_steps,
                args.batch,
                args.chunk_tokens,
                args.signal_at_end,
                args.tp,
                args.max_batch,
                args.decode_block_size,
                args.decode_order,
            )
            for length, why in plan.rejected:
                print(
                    f"pdhal demo: rejected a {length}-token prompt up front: {why}", file=sys.stderr
                )
            if not args.json:
                print(
                    f"pdhal demo: {mode}, {len(plan.requests)} requests, {model.layers} "
                    f"layers, {len(plan.steps)} steps, transport {args.transport}"
                    + (f", {args.tp} tensor-parallel ranks" if args.tp > 1 else ""),
                    file=sys.stderr,
                )
            summary, timeline = pipeline.run(plan, options)
            summaries.append(summary)
            runs.append((plan, timeline))
            if not args.json:
                print(report.format_summary(summary), flush=True)
    except DemoError as exc:
        print(f"pdhal: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_json(summaries), indent=2), flush=True)
    if args.plot:
        try:
            report.plot(runs, args.plot)
        except OSError as exc:  # checked before the run; the disk may have filled since
            print(f"pdhal: error: could not write the plot {args.plot}: {exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"pdhal demo: wrote the timeline to {args.plot}", file=sys.stderr)
    return 0 if all(s["ok"] for s in summaries) else 1


@hookimpl
def pdhal_command() -> Command:
    """`pdhal demo` (entry point `demo` in the `pdhal.commands` group)."""
    return Command(HELP, add_arguments, main)
