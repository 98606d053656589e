"""Run one vLLM instance on token prompts: `python -m pdhal_vllm.testing.instance ROLE ...`.

ROLE is `plain` (no connector), `prefill` (kv_producer with the pdhal connector: each prompt
is prefilled with max_tokens 1 and its KV streamed to the decode side) or `decode`
(kv_consumer: each prompt's KV is loaded from the prefill side, then --max-tokens tokens are
generated greedily). `--connector example` runs vLLM's own ExampleConnector instead (files,
all layers after the forward pass), the baseline of bench/bench_vllm.py.

Prompts are a JSON file: [{"tid": "r0", "tokens": [...]}, ...]; the tid pairs a prompt's
prefill and decode. The result (--out) is JSON: per prompt the tokens, finish reason and
CLOCK_MONOTONIC times of its submission and first output (ns). The instance drives vLLM's
engine step by step in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 is set), which is
what tests and the benchmark need; a server (`vllm serve`) takes the same --kv-transfer-config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pdhal_vllm.config import kv_transfer_config as pdhal_kv_transfer_config
from pdhal_vllm.wire import transport_options


def kv_transfer_config(args) -> dict | None:
    if args.role == "plain":
        return None
    role = "kv_producer" if args.role == "prefill" else "kv_consumer"
    if args.connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": args.storage},
        }
    extra = {
        "transport": args.transport,
        "load_mode": args.load_mode,
        "load_timeout_s": args.load_timeout,
        "transport_options": transport_options(args.transport_option),
    }
    if args.messager:
        extra["messager"] = args.messager
    if args.trace:
        extra["trace"] = args.trace
    config = pdhal_kv_transfer_config(role, args.policy, **extra)
    if args.trace_blocks:
        config["kv_connector"] = "CrcPdhalConnector"
        config["kv_connector_module_path"] = "pdhal_vllm.testing.crc_connector"
    return config


def params(args, prompt: dict):
    from vllm import SamplingParams

    extra = None
    if args.role != "plain" and args.connector == "pdhal":
        transfer = {"pdhal_transfer_id": prompt["tid"]}
        if args.role == "prefill":
            transfer["do_remote_decode"] = True
        else:
            transfer["do_remote_prefill"] = True
            if args.messager:
                transfer["pdhal_messager"] = args.messager
        extra = {"kv_transfer_params": transfer}
    max_tokens = 1 if args.role == "prefill" else args.max_tokens
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def _wait_for(path: str, timeout: float, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(poll)


def _claims_went(args, prompts: list[dict]) -> bool:
    """After the first step: a decode instance (traced) once its worker's claims of every
    prompt went (its trace says "want"; the sessions are made in the background)."""
    from pdhal_vllm.wire import read_trace

    if args.role != "decode" or not args.trace:
        return True
    wanted = {e["tid"] for e in read_trace(f"{args.trace}.decode0.jsonl") if e["kind"] == "want"}
    return wanted >= {p["tid"] for p in prompts}


def _touch(path: str | None) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)


def _held_transfers(worker=None) -> int:
    """Transfers the connector of the worker process this runs in still holds blocks for:
    a prefill's not yet written, a decode's loads not ended (run on each worker by
    collective_rpc, which passes the worker: with TP > 1 they are processes of their own,
    and this process's connector is the scheduler side's)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    worker = getattr(get_kv_transfer_group(), "worker", None)
    return worker.held_transfers() if worker is not None else 0


def run(args) -> dict:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as f:
        prompts = json.load(f)
    config = kv_transfer_config(args)
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        **(
            {"max_num_batched_tokens": args.max_num_batched_tokens}
            if args.max_num_batched_tokens
            else {}
        ),
        dtype=args.dtype,
        seed=0,
        tensor_parallel_size=args.tp,
        enable_prefix_caching=args.prefix_caching,
        kv_transfer_config=config,
    )
    init_s = time.monotonic() - t0
    engine = llm.llm_engine
    _touch(args.ready_file)
    for path in args.wait_file:
        _wait_for(path, args.wait_timeout, args.poll)
    results = {p["tid"]: {"tid": p["tid"], "tokens": [], "finish_reason": None} for p in prompts}
    waiting = list(prompts)

    def submit():
        p = waiting.pop(0)
        results[p["tid"]]["submitted_ns"] = time.monotonic_ns()
        engine.add_request(p["tid"], TokensPrompt(prompt_token_ids=p["tokens"]), params(args, p))

    while waiting and not (args.sequential and engine.has_unfinished_requests()):
        submit()
    steps, submitted = 0, False
    deadline = time.monotonic() + args.timeout
    while engine.has_unfinished_requests() or waiting:
        if waiting and not engine.has_unfinished_requests():  # --sequential: the next one
            submit()
        outputs = engine.step()
        steps += 1
        now = time.monotonic_ns()
        for out in outputs:
            r = results[out.request_id]
            tokens = list(out.outputs[0].token_ids)
            if tokens and "first_token_ns" not in r:
                r["first_token_ns"] = now
            r["tokens"] = tokens
            if out.finished:
                r["finish_reason"] = out.outputs[0].finish_reason
                r["finished_ns"] = now
        if not submitted and _claims_went(args, prompts):
            submitted = True
            _touch(args.submitted_file)  # the decode side has asked for its KV
            if args.cancel_after_submit:
                engine.abort_request([p["tid"] for p in prompts])
                break
        if outputs and all(r["finish_reason"] for r in results.values()):
            _touch(args.finished_file)
        if not outputs:
            time.sleep(0.0002)  # waiting for KV: let the other processes have the CPU
        if time.monotonic() > deadline:
            sys.exit(f"the {args.role} instance did not finish within {args.timeout:.0f} s")
    # A prefill's blocks stay held until the messager has written them, an aborted
    # decode's until its loads ended: keep stepping.
    while sum(llm.collective_rpc(_held_transfers)):
        engine.step()
        time.sleep(0.001)
        if time.monotonic() > deadline:
            sys.exit(f"the {args.role} instance's transfers did not end in time")
    return {
        "role": args.role,
        "init_s": init_s,
        "steps": steps,
        "results": [results[p["tid"]] for p in prompts],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdhal_vllm.testing.instance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("role", choices=("plain", "prefill", "decode"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--connector", choices=("pdhal", "example"), default="pdhal")
    parser.add_argument("--messager", help="HOST:PORT of the prefill rank's messager")
    parser.add_argument("--transport", default="shm", help="any installed transport plugin")
    parser.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--load-mode", choices=("async", "sync"), default="async")
    parser.add_argument("--load-timeout", type=float, default=60.0)
    parser.add_argument("--policy", choices=("recompute", "fail"), default="fail")
    parser.add_argument(
        "--storage", default="/tmp/pdhal-vllm-example", help="the example connector's folder"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", help="the model's and the KV cache's")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor parallelism (worker processes of their own)"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix cache on")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens a step may compute (a prompt longer than this is prefilled in chunks)",
    )
    parser.add_argument(
        "--sequential", action="store_true", help="submit each prompt once the last finished"
    )
    parser.add_argument("--trace", default=None, help="JSON-lines events to PREFIX.ROLE.jsonl")
    parser.add_argument(
        "--trace-blocks",
        action="store_true",
        help="with --trace: crc32 of every block (pdhal_vllm.testing.crc_connector)",
    )
    parser.add_argument("--ready-file", help="touched once the engine is up")
    parser.add_argument(
        "--wait-file",
        action="append",
        default=[],
        help="submit the prompts once this file exists (repeated: once each exists)",
    )
    parser.add_argument("--wait-timeout", type=float, default=120.0)
    parser.add_argument("--submitted-file", help="touched after the first engine step")
    parser.add_argument("--finished-file", help="touched once every prompt finished")
    parser.add_argument(
        "--cancel-after-submit",
        action="store_true",
        help="abort every request after the first engine step (decode: mid-load)",
    )
    parser.add_argument(
        "--poll", type=float, default=0.01, help="seconds between checks for --wait-file"
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = run(args)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
