"""Real-GPU check of pdhal-cuda (run by scripts/gpu-check.sh; needs torch and cupy).

1. Ordering: a stream runs, per layer, a slow kernel (torch.cuda._sleep) then a fill of the
   layer's KV block; pdhal signals the layer right after. A second process maps the KV cache
   through CUDA IPC and, each time a layer is signalled, copies every signalled block back
   and checks its bytes. Any early signal fails the run.
2. Latency: per layer, the time from the producer's stream.synchronize() returning to the
   reader process waking (both host-side views of the same completion).
3. Host-function overhead: GPU wall time of many small layers with and without a signal.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

from pdhal import ops

LAYERS = 64
BLOCK = 1 << 20  # bytes of KV cache per layer

VERIFY = r"""
import json, sys, time
import cupy, numpy as np
from pdhal import ops
layers, block = int(sys.argv[1]), int(sys.argv[2])
kv = ops.share_external_data(np.zeros(1, np.uint8), "gpu_check_kv", [layers * block])
mem = cupy.cuda.UnownedMemory(kv.address, kv.nbytes, owner=None)
dev = cupy.ndarray((layers * block,), dtype=cupy.uint8,
                   memptr=cupy.cuda.MemoryPointer(mem, 0))
reader = ops.open_kv_signal_reader(0, 0, timeout=60)
print("ready", flush=True)
since, seen, checked = reader.current(), {}, 0
while since[1] < layers - 1 or since[0] < 2:
    since = reader.wait(since, timeout=60)
    seen[f"{since[0]}:{since[1]}"] = time.monotonic_ns()
    if since[0] == 1:
        for layer in range(since[1] + 1):
            got = dev[layer * block:(layer + 1) * block].get()
            if not (got == (layer + 1) % 251).all():
                print(json.dumps({"error": f"layer {layer} signalled before its bytes landed"}))
                sys.exit(1)
            checked += 1
print(json.dumps({"seen": seen, "checked": checked}))
"""


def main() -> int:
    assert torch.cuda.is_available()
    kv = torch.zeros(LAYERS * BLOCK, dtype=torch.uint8, device="cuda")
    ops.set_data_ipc(kv, "gpu_check_kv")
    stream = torch.cuda.Stream()
    reader = subprocess.Popen(
        [sys.executable, "-c", VERIFY, str(LAYERS), str(BLOCK)], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout.readline().strip() == "ready"

    # step 1: ordering, all layers queued at once behind slow kernels
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    with torch.cuda.stream(stream):
        for layer in range(LAYERS):
            torch.cuda._sleep(2_000_000)  # ~1 ms at H200 clocks
            kv[layer * BLOCK : (layer + 1) * BLOCK].fill_((layer + 1) % 251)
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream)
    stream.synchronize()

    # step 2: latency, one layer at a time
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    done = {}
    with torch.cuda.stream(stream):
        for layer in range(LAYERS):
            torch.cuda._sleep(200_000)
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream)
            stream.synchronize()
            done[f"2:{layer}"] = time.monotonic_ns()
            time.sleep(0.002)
    result = json.loads(reader.stdout.readline())
    reader.wait()
    if "error" in result:
        print("FAIL:", result["error"])
        return 1
    lat = [(result["seen"][k] - t) / 1000 for k, t in done.items() if k in result["seen"]]
    print(f"ordering: {result['checked']} block checks, all bytes present when signalled")
    if len(lat) >= 2:
        q = statistics.quantiles(lat, n=100)
        print(
            f"latency sync-return -> reader wake: p50 {q[49]:.1f} us, p99 {q[98]:.1f} us "
            f"({len(lat)} layers seen)"
        )

    # step 3: host-function overhead per layer
    small = torch.zeros(1024, device="cuda")

    def run(with_signal: bool, n: int = 2000) -> float:
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for layer in range(n):
                small.add_(1)
                if with_signal:
                    ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer % 1000), stream)
        stream.synchronize()
        return (time.perf_counter() - start) / n * 1e6

    run(True, 200), run(False, 200)  # warm up
    plain, signalled = min(run(False) for _ in range(3)), min(run(True) for _ in range(3))
    print(
        f"per layer: {plain:.2f} us without a signal, {signalled:.2f} us with one: "
        f"host-function overhead {signalled - plain:.2f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
