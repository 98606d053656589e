"""Benchmark for issue #4: the async KV signal sender against the original design.

On the SIMULATED XPU runtime (pdhal-xpu's; no XPU hardware here), a stream runs one
"layer" kernel after another (BENCH_LAYER_US each). After each kernel the stream stamps the
time it finished, then the layer's event fires. Three senders, side by side:
  - pdhal: one thread that polls the queued event (xpu_event_query, yielding) while work is
    queued, and sleeps on a condition variable when nothing is;
  - pdhal, blocking: the same thread without polling (it sleeps in xpu_event_wait);
  - baseline: a C thread that polls its queue every 1 us (bench/poll_sender.c), as the
    engines' XPU path does today.
Printed: latency from "layer finished" to "reader process saw the signal" (p50, p99), CPU
time of the producer for the run, and its CPU while idle (sender alive, nothing queued).
`--json` prints the same as one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import _cbuild

HERE = os.path.dirname(os.path.abspath(__file__))

SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # make bench-smoke: the same runs, tiny sizes
LAYERS = int(os.environ.get("BENCH_LAYERS", "20" if SMOKE else "400"))
LAYER_US = int(os.environ.get("BENCH_LAYER_US", "500"))
IDLE_S = 0.1 if SMOKE else 1.0
ROUNDS = 1 if SMOKE else 2

READER = r"""
import json, sys, time
from pdhal import ops
layers = int(sys.argv[1])
reader = ops.open_kv_signal_reader(0, 0, timeout=60)
print("ready", flush=True)
seen, since = {}, reader.current()
while since[1] < layers - 1:
    since = reader.wait(since, timeout=60)
    seen[since[1]] = time.monotonic_ns()
print(json.dumps(seen))
"""


def run(style: str, sim, baseline) -> tuple[list[float], float, float]:
    import numpy as np

    from pdhal import ops
    from pdhal._backends import registry as _registry
    from pdhal._protocol import core as _core
    from pdhal._protocol import signals as _signals

    meta = ops.open_shm_and_get_meta_signal(0, 0)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(LAYERS)], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout.readline().strip() == "ready"
    rt = _registry.selection().candidate.backend.runtime
    finished = np.zeros(LAYERS, dtype=np.uint64)
    stream = sim.ffi.new("void **")
    sim.lib.xpu_stream_create(stream)
    scratch = sim.ffi.new("char[64]")
    if style.startswith("pdhal"):
        sender = ops.create_kv_signal_sender()
        if style == "pdhal-blocking":
            sender._sender.set_polling(None, 0)
    else:
        sender = baseline.lib.poll_sender_start(
            baseline.ffi.cast("void *", rt.address(rt.lib.xpu_event_wait)),
            baseline.ffi.cast("void *", rt.address(rt.lib.xpu_event_destroy)),
            baseline.ffi.cast("void *", _core.STORE_CALLBACK_ADDRESS),
        )
    cpu0 = time.process_time()
    for layer in range(LAYERS):
        sim.lib.sim_xpu_launch_write(stream[0], scratch, b"k" * 64, 64, LAYER_US)
        sim.lib.sim_xpu_launch_timestamp(
            stream[0], sim.ffi.cast("uint64_t *", finished.ctypes.data + 8 * layer)
        )
        signal = ops.init_signal_layerwise(meta, layer)
        if style.startswith("pdhal"):
            ops.signal_layer_ready(signal, int(sim.ffi.cast("uintptr_t", stream[0])), sender)
        else:
            event = rt.ffi.new("XPUEvent *")
            rt.lib.xpu_event_create(event)
            rt.lib.xpu_event_record(event[0], rt.ffi.cast("void *", stream[0]))
            store = signal.new_store()
            baseline.lib.poll_sender_post(
                sender,
                baseline.ffi.cast("void *", rt.address(event[0])),
                baseline.ffi.cast("void *", _core.store_address(store)),
            )
    seen = json.loads(reader.stdout.readline())
    cpu = time.process_time() - cpu0
    idle0 = time.process_time()
    time.sleep(IDLE_S)  # between steps a sender mostly waits for work
    idle = (time.process_time() - idle0) / IDLE_S
    if style.startswith("pdhal"):
        sender.close()
    else:
        baseline.lib.poll_sender_stop(sender)
    reader.wait()
    sim.lib.xpu_stream_destroy(stream[0])
    _signals.close_producer_channels()
    lat = [(seen[str(k)] - int(finished[k])) / 1000 for k in range(LAYERS) if str(k) in seen]
    return lat, cpu, idle


class Loaded:
    """A C library bound with cffi (ABI mode): .ffi and .lib."""

    def __init__(self, path: str, cdef: str):
        from cffi import FFI

        self.ffi = FFI()
        self.ffi.cdef(cdef)
        self.lib = self.ffi.dlopen(path)


def main() -> int:
    from pdhal_xpu.testing import XpuTestSupport

    os.environ.setdefault("PDHAL_NAMESPACE", f"bench{os.getpid()}")
    os.environ["PDHAL_XPURT"] = XpuTestSupport.simulator()
    os.environ["PDHAL_PLATFORM"] = "xpu"
    sim = Loaded(
        os.environ["PDHAL_XPURT"],
        """
        int xpu_stream_create(void **s); int xpu_stream_destroy(void *s);
        int sim_xpu_launch_write(void *s, void *dst, const void *src, uint64_t n, uint32_t us);
        int sim_xpu_launch_timestamp(void *s, uint64_t *dst);""",
    )
    baseline = Loaded(
        _cbuild.build(os.path.join(HERE, "poll_sender.c"), "libpoll_sender.so"),
        """
        void *poll_sender_start(void *wait, void *destroy, void *store);
        void poll_sender_post(void *s, void *event, void *store);
        void poll_sender_stop(void *s);""",
    )

    import pdhal

    assert pdhal.current_backend() == "xpu"
    as_json = "--json" in sys.argv[1:]
    styles = ("pdhal", "pdhal-blocking", "poll-1us")
    rows = {
        style: {"p50_us": [], "p99_us": [], "cpu_s": [], "idle_cpu_pct": []} for style in styles
    }
    if not as_json:
        print(f"simulated XPU runtime, {LAYERS} layers of {LAYER_US} us each")
        print("sender            latency p50 us    p99 us   seen   CPU s (run)   idle CPU %")
    for _ in range(ROUNDS):  # interleaved rounds
        for style in styles:
            lat, cpu, idle = run(style, sim, baseline)
            q = statistics.quantiles(lat, n=100)
            row = rows[style]
            row["p50_us"].append(q[49])
            row["p99_us"].append(q[98])
            row["cpu_s"].append(cpu)
            row["idle_cpu_pct"].append(idle * 100)
            if not as_json:
                print(
                    f"  {style:<14} {q[49]:16.1f} {q[98]:9.1f} {len(lat):6d} {cpu:13.3f} "
                    f"{idle * 100:12.2f}"
                )
    p50 = {style: statistics.median(rows[style]["p50_us"]) for style in styles}
    if as_json:
        print(
            json.dumps(
                {
                    "layers": LAYERS,
                    "layer_us": LAYER_US,
                    "runs": rows,
                    "p50_ratio_pdhal_to_poll": p50["pdhal"] / p50["poll-1us"],
                }
            )
        )
    else:
        print(
            f"p50 pdhal / poll-1us: {p50['pdhal'] / p50['poll-1us']:.2f}x "
            f"(blocking: {p50['pdhal-blocking'] / p50['poll-1us']:.2f}x); run: "
            f"~{LAYERS * LAYER_US / 1e6:.1f} s of layers; idle: {IDLE_S:g} s with the sender "
            f"alive and nothing queued (CPU of the whole producer process)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
