"""Benchmark: pdhal.transfer's streamer while the model computes, against the floors it is
judged by, side by side in one run.

A worker process stands in for the model: each step it computes every layer (a numpy
matmul sized to about BENCH_LAYER_MS), writes the layer's KV blocks of BENCH_REQUESTS
requests into its caches (pdhal shared memory), notes the time and signals the layer (per
query). This process is the cache messager: it waits on the channel and, per layer, either
hands the layer to a KVStreamer over the shm transport into a decode process's KVReceiver
(even steps) or memmoves the very same runs into the same decode caches itself (odd steps:
the floor; the decode caches' pages are mapped in this process before the first step, as
a serving messager's are after its first ones). The caches are the demo's default model's
(32 layers, K and V, blocks of 64 tokens x 4 heads x 32 dims x fp32 = 32 KiB).

- shm_vs_memcpy_under_compute: memmove time / streamer time for the same bytes, each
  averaged over layers from the messager's wake-up for the layer to the bytes being in the
  decode cache (the floor: its memmove returned; the streamer: the streamer knew the layer
  landed, its LayerRecord's end, however many threads that took), while the worker
  computes on the other core (1.0: the streamer costs nothing over the copy).
- signal_to_submit_vs_floor: p50 of (submit - the worker's signal time) over p50 of the
  kernel wake floor: this process blocked in read() on a pipe the worker writes its
  timestamp to after each layer, on the floor steps (the same worker, computing on the
  other core, the same run: a wake across processes and cores, as the signal's is).
  wake_floor_threads_us_p50 is the same wake between two threads of this process (which
  the kernel may run on one core), printed for comparison. Both sides count only the wakes
  of an idle reader (one new layer found: the reader was blocked when it came); a layer
  signalled while the messager still copied the one before waits behind it, which
  signal_to_submit_all_layers_us_p50 shows.
- followed_*: the same, each streamed step one KVStreamer.follow() instead of a
  layer_ready per signal: the link's copier thread sleeps on the channel's futex and
  starts each layer's copies at its signal (submit = when it saw it). signal_to_submit is
  then the worker's timestamp to that, the floor that run's own; a layer counts as one
  that found the link idle when the layer before had settled before its signal.
- exposed_ms_p50 / exposed_ms_p99 (the headline; p99: the slow tail), overlap_efficiency_p50
  / overlap_efficiency_p1 (p1: the low tail): per request, as pdhal.transfer defines them
  (pdhal/_transfer/metrics.py), from the streamer's own records: landed minus the worker's
  signal time of the last layer (layer_ready is given it), and the share of the request's
  first submit -> landed before that signal; layer_compute_ms: the worker's p50 layer time.
  gib_s (Mooncake) is over the transfers' busy time (the union of their submit -> landed).
- mooncake_vs_te_bench_under_compute: the streamer over Mooncake (TCP, loopback; every step
  streamed) in GiB/s while it transfers, over Mooncake's own transfer_engine_bench with the
  same block size and batch, one thread, while a core computes.

- heterogeneous_vs_alike (MODE): bench_block_sizes' ratios, a head's token 128 bytes as
  here: the same bytes into decode caches of other block sizes, another order, K and V
  together, against caches alike (issue 35's target: >= 0.8);
  heterogeneous_pieces_alone (MODE): what copies of that mode's sizes cost by themselves
  (bench_block_sizes' "pieces alone": a memcpy each, contiguous, against one per block).

`--json` prints one object; BENCH_SMOKE=1 (make bench-smoke) runs the same on tiny sizes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import statistics
import struct
import subprocess
import sys
import threading
import time

import bench_block_sizes  # (this folder: the script's own)

SMOKE = os.environ.get("BENCH_SMOKE") == "1"
LAYERS = int(os.environ.get("BENCH_LAYERS", "4" if SMOKE else "32"))
STEPS = int(os.environ.get("BENCH_STEPS", "2" if SMOKE else "16"))  # half streamer, half floor
REQUESTS = int(os.environ.get("BENCH_REQUESTS", "2" if SMOKE else "4"))
BLOCKS_PER_REQUEST = int(os.environ.get("BENCH_BLOCKS", "2" if SMOKE else "8"))
BLOCK_TOKENS = 64
BLOCK_BYTES = int(os.environ.get("BENCH_BLOCK_BYTES", str(4 * 64 * 32 * 4)))
LAYER_MS = float(os.environ.get("BENCH_LAYER_MS", "0.5" if SMOKE else "2"))
WAKES = 40 if SMOKE else 400
BLOCKS = REQUESTS * BLOCKS_PER_REQUEST

WORKER = f"""
import os, struct, sys, time
import numpy as np
from pdhal import ops
L, B, BB, STEPS = {LAYERS}, {BLOCKS}, {BLOCK_BYTES}, {STEPS}
floor_fd, with_floor = int(sys.argv[1]), sys.argv[2] == "1"
buffers = [[ops.host_alloc(B * BB) for _ in "KV"] for _ in range(L)]
for layer, row in enumerate(buffers):
    for kv, buf in enumerate(row):
        ops.set_data_ipc(buf, f"bench.prefill.l{{layer}}{{kv}}")
caches = [[b.as_numpy("uint8", (B, BB)) for b in row] for row in buffers]
times_buf = ops.host_alloc(8 * STEPS * L)
ops.set_data_ipc(times_buf, "bench.times")
times = times_buf.as_numpy("int64", (STEPS, L))
a = np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)
def compute(ms):
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a
print("ready", flush=True)
sys.stdin.readline()
layer_ms = []
for step in range(STEPS):
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    for layer in range(L):
        t = time.perf_counter()
        compute({LAYER_MS})
        for kv in range(2):
            caches[layer][kv][:] = (step + layer + kv) % 251
        layer_ms.append((time.perf_counter() - t) * 1e3)
        times[step, layer] = time.monotonic_ns()
        if with_floor and step % 2:  # a floor step: the messager waits in read()
            os.write(floor_fd, struct.pack("<qq", layer, times[step, layer]))
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
    sys.stdin.readline()  # the messager is done with this step
print(sorted(layer_ms)[len(layer_ms) // 2], flush=True)
sys.stdin.readline()
"""

DECODE = f"""
import json, sys
from pdhal import ops, transfer
L, B, BB = {LAYERS}, {BLOCKS}, {BLOCK_BYTES}
buffers = [[ops.host_alloc(B * BB) for _ in "KV"] for _ in range(L)]
caches = [[b.as_numpy("uint8", (B, BB)) for b in row] for row in buffers]
receiver = transfer.KVReceiver(
    transfer.CacheLayout.from_caches(caches), "bench-decode", transport_name=sys.argv[1]
)
print(json.dumps(receiver.describe()), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command[0] == "expect":
        print(json.dumps([receiver.expect(r, 60.0) for r in command[1]]), flush=True)
    elif command[0] == "wait":
        print(json.dumps([receiver.wait(r).landed for r in command[1]]), flush=True)
    else:
        break
receiver.close()
"""

COMPUTE = """
import time
import numpy as np
a = np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)
while True:
    a @ a
"""


def child(code: str, *args: str, pass_fds=()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        pass_fds=pass_fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if "mooncake" in args else None,  # Mooncake's own logging
        text=True,
        # numpy's BLAS would run each matmul on every core: the stand-in model computes on
        # one, so the copies under test (and the floor's) have the other to themselves
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )


def say(proc: subprocess.Popen, line: str = "") -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def wake_floor() -> list[float]:
    """Microseconds from a writer's timestamp to a reader blocked in read() having it: two
    threads of this process."""
    r, w = os.pipe()
    samples = []

    def reader():
        for _ in range(WAKES):
            sent = int.from_bytes(os.read(r, 8), "little")
            samples.append((time.monotonic_ns() - sent) / 1e3)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(WAKES):
        time.sleep(0.0005)  # the reader is asleep in read() again
        os.write(w, time.monotonic_ns().to_bytes(8, "little"))
    thread.join()
    os.close(r)
    os.close(w)
    return samples


def phase(transport_name: str, with_floor: bool, follow: bool = False) -> dict:
    """One run of the worker's steps through a streamer over `transport_name`; with_floor:
    every other step memmoves the same runs instead (shm: the floor it is judged by);
    follow: each streamed step is one KVStreamer.follow() (the link waits for each layer's
    signal itself), not a layer_ready per signal."""
    from pdhal import ops, transfer

    os.environ["PDHAL_NAMESPACE"] = f"bench{os.getpid()}{transport_name}"
    floor_r, floor_w = os.pipe()
    worker = child(WORKER, str(floor_w), "1" if with_floor else "0", pass_fds=(floor_w,))
    os.close(floor_w)
    decode = child(DECODE, transport_name)
    assert worker.stdout.readline().strip() == "ready"
    described = json.loads(decode.stdout.readline())
    prefill = [
        [
            ops.share_external_data("uint8", f"bench.prefill.l{layer}{kv}", [BLOCKS, BLOCK_BYTES])
            for kv in range(2)
        ]
        for layer in range(LAYERS)
    ]
    times = ops.share_external_data("int64", "bench.times", [STEPS, LAYERS])
    layout = transfer.CacheLayout.from_caches(prefill)
    streamer = transfer.KVStreamer(
        layout, BLOCK_TOKENS, transport_name=transport_name, max_layers_in_flight=8
    )
    dest = streamer.connect(described)
    blocks = list(range(BLOCKS))
    runs = transfer.block_runs(blocks, blocks[::-1])  # scattered: one run per block
    if with_floor:
        bases = [ops.get_data_ptr_ipc(None, name) for name in described["names"]]
        # a byte of each page of the decode caches read: their pages mapped here once (the
        # link's mapping is this one), as a serving messager's are after its first steps,
        # so that neither the streamed steps nor the floor's pay for touching them first
        for base, size in zip(bases, described["regions"]):
            sum((ctypes.c_uint8 * size).from_address(base)[::4096])
        floor_runs = [
            [
                (src, bases[region] + offset, n)
                for src, region, offset, n in dest.planner.copies(layer, runs)
            ]
            for layer in range(LAYERS)
        ]
    memmoved_us = []  # per floor layer: wake -> its memmove returned
    woke_for = {}  # (step, layer) streamed -> when the messager woke for it
    woken = []  # (layer signalled last, when the reader returned)
    floor = []  # the same, woken from read() on the worker's pipe
    alone = set()  # (step, layer) that woke an idle messager, the only new layer it found
    reader = None
    say(worker)
    for step in range(STEPS):
        streaming = not with_floor or step % 2 == 0
        ids = [f"s{step}r{r}" for r in range(REQUESTS)]
        if streaming:
            say(decode, json.dumps(["expect", ids]))
            tickets = json.loads(decode.stdout.readline())
            for r, (request, ticket) in enumerate(zip(ids, tickets)):
                own = blocks[r * BLOCKS_PER_REQUEST : (r + 1) * BLOCKS_PER_REQUEST]
                streamer.add_request(request, own, BLOCKS_PER_REQUEST * BLOCK_TOKENS)
                streamer.set_destination(request, dest, own[::-1], ticket)
        if reader is None:
            reader = ops.open_kv_signal_reader(0, 0, timeout=60)
            seen = (0, -1)
        if streaming and follow:  # every layer of the step at once (step numbers from 1)
            ready = [(r, BLOCKS_PER_REQUEST * BLOCK_TOKENS) for r in ids]
            streamer.follow(reader, step + 1, ready)
            seen = (step + 1, LAYERS - 1)
        done = -1 if not (streaming and follow) else LAYERS - 1
        while done < LAYERS - 1:
            if streaming:
                seen = reader.wait(seen, timeout=60)
                woke = time.monotonic_ns()
                if seen[0] != step + 1:
                    continue
                if seen[1] >= 0:
                    woken.append((woke - int(times[step, seen[1]])) / 1e3)
                upto = seen[1]
                if upto == done + 1:
                    alone.add((step, upto))
            else:  # everything the worker wrote since: its newest (layer, time) counts
                got = os.read(floor_r, 4096)
                woke = time.monotonic_ns()
                upto, sent = struct.unpack_from("<qq", got, len(got) - 16)
                if upto == done + 1:  # the same filter: one new layer, a reader idle
                    floor.append((woke - sent) / 1e3)
            for layer in range(done + 1, upto + 1):
                if streaming:
                    woke_for[(step, layer)] = woke
                    ready = [(r, BLOCKS_PER_REQUEST * BLOCK_TOKENS) for r in ids]
                    signal_ns = int(times[step, layer])
                    streamer.layer_ready(layer, ready, signal_ns=signal_ns, step=step)
                else:
                    for src, dst, n in floor_runs[layer]:
                        ctypes.memmove(dst, src, n)
                    memmoved_us.append((time.monotonic_ns() - woke) / 1e3)
            done = upto
        if streaming:
            ended = []
            while len(ended) < REQUESTS:  # waiting, not polling: the GIL stays free
                ended += streamer.poll(timeout=60)
            assert all(o.landed for o in ended), ended
            say(decode, json.dumps(["wait", ids]))
            assert all(json.loads(decode.stdout.readline()))
        say(worker)
    layer_ms = float(worker.stdout.readline())
    records = streamer.metrics.layers()
    snapshot = streamer.metrics.snapshot()  # the streamed steps' requests, all in its window
    streamer.close()
    reader.close()
    os.close(floor_r)
    say(worker)
    say(decode, json.dumps(["exit"]))
    for proc in (worker, decode):
        proc.wait(timeout=60)
    streamed_bytes = sum(r.nbytes for r in records)
    busy = [(r.submit_ns, r.end_ns) for r in records]
    if follow:  # a record's step is the channel's (from 1): this loop's step + 1
        records = [dataclasses.replace(r, step=r.step - 1) for r in records]
    signalled = {(r.step, r.layer): int(times[r.step, r.layer]) for r in records}
    if follow:  # the link woke for each layer: its submit; idle when the layer before ended
        woke_for = {(r.step, r.layer): r.submit_ns for r in records}
        ended = {(r.step, r.layer): r.end_ns for r in records}
        alone = {
            key
            for key in signalled
            if key[1] == 0 or ended.get((key[0], key[1] - 1), 1 << 62) < signalled[key]
        }
    return {
        "streamed_us": [(r.end_ns - woke_for[(r.step, r.layer)]) / 1e3 for r in records],
        "memmoved_us": memmoved_us,
        "signal_to_submit_us": [
            (r.submit_ns - signalled[(r.step, r.layer)]) / 1e3
            for r in records
            if (r.step, r.layer) in alone
        ],
        "signal_to_submit_all_us": [
            (r.submit_ns - signalled[(r.step, r.layer)]) / 1e3 for r in records
        ],
        "signal_to_wake_us": woken,
        "wake_floor_us": floor,
        "layer_ms": layer_ms,
        "gib_s": streamed_bytes / (transfer.TransferMetrics.busy_ns(busy) / 1e9) / 2**30,
        "snapshot": snapshot,
    }


def te_bench_under_compute() -> float | None:
    """Mooncake's transfer_engine_bench (write, TCP, loopback; the streamer's block size and
    batch, one thread) while a core computes as the worker does."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_demo import transfer_engine_bench

    load = child(COMPUTE)
    try:
        return transfer_engine_bench(BLOCK_BYTES, 2 * BLOCKS, seconds=1 if SMOKE else 3)
    finally:
        load.kill()
        load.wait()


def _headline(snapshot: dict) -> dict:
    """Exposed transfer and overlap efficiency per request, as the streamer measured them."""
    keys = ("exposed_ms_p50", "exposed_ms_p99", "overlap_efficiency_p50", "overlap_efficiency_p1")
    return {k: snapshot[k] for k in keys}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _followed(run: dict) -> dict:
    """The same ratios for steps the streamer followed (one follow() per step: the link's
    copier woke by each layer's signal), against the floors of that run."""
    floor = run["wake_floor_us"]
    return {
        "followed_signal_to_submit_vs_floor": _median(run["signal_to_submit_us"]) / _median(floor)
        if run["signal_to_submit_us"] and floor
        else None,
        "followed_shm_vs_memcpy_under_compute": statistics.mean(run["memmoved_us"])
        / statistics.mean(run["streamed_us"]),
        "followed_signal_to_submit_us_p50": _median(run["signal_to_submit_us"]),
        "followed_signal_to_submit_all_layers_us_p50": _median(run["signal_to_submit_all_us"]),
        "followed_wake_floor_us_p50": _median(floor),
        **{f"followed_{k}": v for k, v in _headline(run["snapshot"]).items()},
    }


def main() -> dict:
    shm = phase("shm", with_floor=True)
    floor = shm["wake_floor_us"]
    load = child(COMPUTE)  # while a core computes as the worker did
    threads_floor = wake_floor()
    load.kill()
    load.wait()
    result = {
        **_headline(shm["snapshot"]),
        "shm_vs_memcpy_under_compute": statistics.mean(shm["memmoved_us"])
        / statistics.mean(shm["streamed_us"]),
        "mooncake_vs_te_bench_under_compute": None,
        # None when no wake found the reader idle (a loaded machine, or BENCH_SMOKE's few)
        "signal_to_submit_vs_floor": _median(shm["signal_to_submit_us"]) / _median(floor)
        if shm["signal_to_submit_us"] and floor
        else None,
        "signal_to_submit_us_p50": _median(shm["signal_to_submit_us"]),
        "signal_to_submit_all_layers_us_p50": statistics.median(shm["signal_to_submit_all_us"]),
        "wake_floor_us_p50": _median(floor),
        "wake_floor_threads_us_p50": statistics.median(threads_floor),
        "signal_to_wake_us_p50": statistics.median(shm["signal_to_wake_us"]),
        **_followed(phase("shm", with_floor=True, follow=True)),
        "layer_compute_ms": shm["layer_ms"],
        "bytes_per_layer": REQUESTS * BLOCKS_PER_REQUEST * 2 * BLOCK_BYTES,
        "layers": LAYERS,
        "steps": STEPS,
        "shm": shm["snapshot"],
    }
    # the same bytes between caches laid out otherwise on the decode side (issue 35), a
    # head's token as this run's (32 dims of fp32): bench_block_sizes' modes
    for mode, row in bench_block_sizes.measure(128).items():
        result[f"heterogeneous_vs_alike ({mode})"] = round(row["vs_alike"], 3)
        if row["pieces_alone"]:
            result[f"heterogeneous_pieces_alone ({mode})"] = round(row["pieces_alone"], 3)
    try:
        mooncake = phase("mooncake", with_floor=False)
    except Exception as e:  # no Mooncake here: say why, measure the rest
        result["mooncake_note"] = f"{type(e).__name__}: {e}"
        return result
    reference = te_bench_under_compute()
    result["mooncake_gib_s"] = mooncake["gib_s"]
    result["te_bench_gib_s"] = reference
    if reference:
        result["mooncake_vs_te_bench_under_compute"] = mooncake["gib_s"] / reference
    result.update({f"mooncake_{k}": v for k, v in _headline(mooncake["snapshot"]).items()})
    result["mooncake"] = mooncake["snapshot"]
    return result


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if not isinstance(value, dict):
                print(f"{key}: {value}")
