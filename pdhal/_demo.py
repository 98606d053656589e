"""`pdhal demo`: a producer process streams layer signals to this process, which checks them.

The smallest real end-to-end exchange: the producer is launched on its device through the
platform's child_env, signals every layer of every step (per query, then per chunk), and the
reader here verifies that each arrives exactly once, in order, with none lost.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pdhal
from pdhal import ops


def produce(mode: str, steps: int, layers: int) -> None:
    """Run in the child: signal `layers` layers for each of `steps` steps."""
    rank = int(os.environ["PDHAL_DEMO_RANK"])
    for step in range(steps):
        if mode == "per_query":
            meta = ops.open_shm_and_get_meta_signal(rank, 0)
            signals = [ops.init_signal_layerwise(meta, i) for i in range(layers)]
        else:
            batch = 4
            encoder = [64 * (step % 3 + 1) if i % 2 == 0 else 0 for i in range(batch)]
            chunk = ops.init_kv_signal_per_query(encoder, encoder, [step] * batch, rank, layers)
            signals = [chunk.layer(i) for i in range(layers)]
        for signal in signals:
            ops.signal_layer_ready(signal)
    time.sleep(0.2)  # let the reader see the end before the channel is unlinked


def _spawn(mode: str, steps: int, layers: int, rank: int) -> subprocess.Popen:
    env = pdhal.current_platform().child_env([pdhal.current_platform().physical_device_id(0)])
    env["PDHAL_DEMO_RANK"] = str(rank)
    code = f"from pdhal._demo import produce; produce({mode!r}, {steps}, {layers})"
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def _read_per_query(rank: int, steps: int, layers: int) -> int:
    seen = 0
    with ops.open_kv_signal_reader(rank, 0, timeout=30) as reader:
        last = (0, -1)
        while last != (steps, layers - 1):
            now = reader.wait(last, timeout=30)
            if now <= last:
                raise AssertionError(f"progress went backwards: {last} -> {now}")
            seen += 1
            last = now
    return seen


def _read_per_chunk(rank: int, steps: int, layers: int) -> int:
    import array

    out = array.array("i", [0] * 1538)
    with ops.open_kv_chunk_reader(rank, 0, timeout=30) as reader:
        for step in range(1, steps + 1):
            for layer in range(layers):
                got = reader.next(out, wait=True, timeout=30)
                if got != step or out[1] != layer:
                    raise AssertionError(f"expected step {step} layer {layer}, got step {got} "
                                         f"layer {out[1]}")
    return steps * layers


def main(args) -> int:
    modes = ["per_query", "per_chunk"] if args.mode == "both" else [args.mode]
    results = []
    for rank, mode in enumerate(modes):
        child = _spawn(mode, args.steps, args.layers, rank)
        start = time.perf_counter()
        try:
            read = _read_per_query if mode == "per_query" else _read_per_chunk
            observed = read(rank, args.steps, args.layers)
        finally:
            code = child.wait(timeout=60)
        elapsed = time.perf_counter() - start
        results.append({"mode": mode, "steps": args.steps, "layers": args.layers,
                        "observations": observed, "seconds": round(elapsed, 3),
                        "producer_exit": code, "backend": pdhal.current_backend()})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{r['mode']:<10} {r['steps']} steps x {r['layers']} layers on {r['backend']}: "
                  f"{r['observations']} observations verified in order in {r['seconds']} s "
                  f"(producer exit {r['producer_exit']})")
    return 0 if all(r["producer_exit"] == 0 for r in results) else 1
