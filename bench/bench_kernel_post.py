"""Per-layer cost of posting a layer signal on the host: from a C attention op through the
kernel form (tests/c/attention_op.c, FastDeploy's launch line) against Python's
signal_layer_ready, side by side in one run, on pdhal-cuda's simulated CUDA runtime with
no write delay.

What is timed is the launch line alone, the host-side cost an engine pays per layer:
    C:      cudaLaunchHostFunc(stream, pdhal_store_run, pdhal_signal_store(kv_signal_data))
            N times in a C loop, timed with clock_gettime (pdhal_now_ns) in C;
    Python: pdhal.ops.signal_layer_ready(signal, stream) N times, given the LayerSignal and
            given its kernel form (the int64 words an engine would hand its op).
Every store runs later on the simulated stream's thread (as on a GPU); the stream is
drained between measurements, untimed. Rounds interleave the three, alternating which goes
first, and the medians are reported (these machines are noisy). Nothing here asserts a
speed.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time

import _cbuild

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # make bench-smoke: the same runs, tiny sizes
LAYERS = int(os.environ.get("BENCH_LAYERS", "200" if SMOKE else "20000"))  # posts per measurement
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "1" if SMOKE else "9"))


def simulated_cuda() -> str:
    """The simulated CUDA runtime, built if needed, selected for this process."""
    from pdhal_cuda.testing import CudaTestSupport

    path = CudaTestSupport.simulator()
    os.environ["PDHAL_CUDART"] = path
    os.environ["PDHAL_PLATFORM"] = "cuda"
    return path


def build_op(runtime: str) -> ctypes.CDLL:
    """tests/c/attention_op.c for CUDA, built as an engine builds its op."""
    library = _cbuild.build(
        os.path.join(ROOT, "tests", "c", "attention_op.c"),
        "libattention_op_cuda.so",
        "-DATTENTION_OP_CUDA",
        runtime,
    )
    op = ctypes.CDLL(library)
    op.bench_cuda_posts.restype = ctypes.c_int64
    op.bench_cuda_posts.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return op


def main() -> int:
    os.environ.setdefault("PDHAL_NAMESPACE", f"bench{os.getpid()}")
    runtime = simulated_cuda()
    import numpy as np

    import pdhal
    from pdhal import ops
    from pdhal._backends import registry as _registry
    from pdhal._protocol import signals as _signals

    assert pdhal.current_backend() == "cuda", pdhal.current_backend()
    op = build_op(runtime)
    support = _registry.selection().candidate.backend.test_support()
    stream = support.new_stream()
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    signal = ops.init_signal_layerwise(meta, 0)  # the same layer each time: cost, not order
    words = np.frombuffer(signal.kernel_form, np.int64).copy()
    post = ops.signal_layer_ready

    def c_op() -> float:
        ns = op.bench_cuda_posts(stream, words.ctypes.data, LAYERS)
        assert ns > 0, f"bench_cuda_posts failed: {ns}"
        return ns / LAYERS

    def python(arg) -> float:
        start = time.perf_counter_ns()
        for _ in range(LAYERS):
            post(arg, stream)
        return (time.perf_counter_ns() - start) / LAYERS

    runs = {"c": c_op, "signal": lambda: python(signal), "words": lambda: python(words)}
    for run in runs.values():  # warm-up: first-call costs, allocator growth
        run()
        ops.synchronize(stream)
    timings = {name: [] for name in runs}
    order = list(runs)
    for round_ in range(ROUNDS):
        for name in order if round_ % 2 == 0 else order[::-1]:
            timings[name].append(runs[name]())
            ops.synchronize(stream)  # the stream's thread has run every store: untimed
    ratios = {
        name: statistics.median(p / c for p, c in zip(timings[name], timings["c"]))
        for name in ("signal", "words")
    }
    med = {name: statistics.median(values) for name, values in timings.items()}
    print(
        f"posting one layer, host side (ns/layer; medians of {ROUNDS} interleaved rounds of "
        f"{LAYERS}; simulated CUDA, no write delay)"
    )
    print(f"  C op: kernel form, cudaLaunchHostFunc(pdhal_store_run)   {med['c']:8.0f}")
    print(
        f"  Python signal_layer_ready(LayerSignal, stream)            {med['signal']:8.0f}"
        f"   {ratios['signal']:5.1f}x the C op"
    )
    print(
        f"  Python signal_layer_ready(kernel-form words, stream)      {med['words']:8.0f}"
        f"   {ratios['words']:5.1f}x the C op"
    )
    _signals.close_producer_channels()
    support.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
