"""Benchmark: pdhal's block copy (pdhal.ops.copy_blocks, cpu backend) against a plain memcpy
of the same bytes from Python (ctypes.memmove per block, or per run of consecutive blocks).

Two KV caches of host memory (from host_alloc, passed as the objects an engine passes), block
sizes of a real KV block (64 tokens x 8 heads x 128 dims x 2 bytes = 128 KiB) and a small one
(4 KiB); each call copies BENCH_BLOCKS blocks:
  - scattered: every block its own run (random ids on both sides), memcpy once per block;
  - runs of 8, and one long run: consecutive ids on both sides, memcpy once per run.
Rounds interleave pdhal and memcpy (alternating which goes first); each prints the median of
BENCH_ROUNDS rounds and the ratio memcpy time / pdhal time (1.0: as fast as memcpy; the
issue's target is >= 0.9). "C loop" is pdhal's C core alone (pdhal_copy_blocks through cffi,
addresses and extents known): what the copy costs without pdhal's Python checks.

Then a profile of the Python overhead at 64-byte blocks (copying is free there): the fixed
cost per call and the cost per block id, split into its parts. `--json` prints one object.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import statistics
import sys
import time

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "15"))
BLOCKS = int(os.environ.get("BENCH_BLOCKS", "64"))  # blocks per call
CACHE_BYTES = int(os.environ.get("BENCH_CACHE_MIB", "64")) << 20  # per side, beyond the LLC
TARGET_S = float(os.environ.get("BENCH_SAMPLE_S", "0.02"))  # per timing sample

BLOCK_SIZES = [("128 KiB (64 tok x 8 heads x 128 x bf16)", 64 * 8 * 128 * 2), ("4 KiB", 4096)]
LAYOUTS = [("scattered (1-block runs)", 1), ("runs of 8", 8), (f"one run of {BLOCKS}", BLOCKS)]


def make_ids(rng: random.Random, cache_blocks: int, run: int) -> tuple[list[int], list[int]]:
    """BLOCKS ids per side in runs of `run` consecutive ids; runs never continue each other."""
    runs = BLOCKS // run
    slots = cache_blocks // (run + 1)  # a gap after every run slot: no accidental merging
    ids = []
    for _ in range(2):
        starts = rng.sample(range(slots), runs)
        ids.append([s * (run + 1) + i for s in starts for i in range(run)])
    return ids[0], ids[1]


def runs_of(dst_ids: list[int], src_ids: list[int]) -> list[tuple[int, int, int]]:
    """(dst id, src id, blocks) of each run of consecutive ids on both sides."""
    out = []
    for d, s in zip(dst_ids, src_ids):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((d, s, 1))
    return out


def per_call(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def calibrate(fn) -> int:
    """Repetitions of `fn` that take about TARGET_S."""
    reps = 1
    while per_call(fn, reps) * reps < TARGET_S:
        reps *= 2
    return reps


def bench_copies(ops, core) -> list[dict]:
    rng = random.Random(7)
    results = []
    for size_name, block_bytes in BLOCK_SIZES:
        cache_blocks = CACHE_BYTES // block_bytes
        dst, src = ops.host_alloc(CACHE_BYTES), ops.host_alloc(CACHE_BYTES)
        ctypes.memset(dst.address, 0, CACHE_BYTES)  # fault every page in before timing
        ctypes.memset(src.address, 1, CACHE_BYTES)
        da, sa = dst.address, src.address
        for layout_name, run in LAYOUTS:
            samples = {"pdhal": [], "memcpy": [], "C loop": []}
            copies = reps = None
            for round_ in range(ROUNDS):
                dst_ids, src_ids = make_ids(rng, cache_blocks, run)
                plan = [
                    (da + d * block_bytes, sa + s * block_bytes, n * block_bytes)
                    for d, s, n in runs_of(dst_ids, src_ids)
                ]
                memmove = ctypes.memmove

                def pdhal_copy():
                    return ops.copy_blocks(dst, dst_ids, src, src_ids, block_bytes)

                if run == 1:  # the plain copy an engine writes: one memcpy per block

                    def plain_copy():
                        for d, s in zip(dst_ids, src_ids):
                            memmove(da + d * block_bytes, sa + s * block_bytes, block_bytes)
                else:  # ... or one per run, its runs found beforehand (not timed)

                    def plain_copy():
                        for to, frm, n in plan:
                            memmove(to, frm, n)

                def c_loop():
                    return core.copy_blocks(
                        0, 0, 0, da, cache_blocks, sa, cache_blocks, block_bytes, dst_ids, src_ids
                    )

                copies = pdhal_copy()
                assert copies == len(plan), (copies, len(plan))
                fns = [("pdhal", pdhal_copy), ("memcpy", plain_copy), ("C loop", c_loop)]
                if round_ % 2:
                    fns.reverse()
                reps = reps or calibrate(plain_copy)
                for name, fn in fns:
                    fn()  # same cache state for each: the ids' blocks were just touched
                    samples[name].append(per_call(fn, reps))
            med = {k: statistics.median(v) for k, v in samples.items()}
            results.append(
                {
                    "block": size_name,
                    "block_bytes": block_bytes,
                    "layout": layout_name,
                    "blocks_per_call": BLOCKS,
                    "copies_per_call": copies,
                    "pdhal_us": med["pdhal"] * 1e6,
                    "memcpy_us": med["memcpy"] * 1e6,
                    "c_loop_us": med["C loop"] * 1e6,
                    "pdhal_gbps": BLOCKS * block_bytes / med["pdhal"] / 1e9,
                    "memcpy_gbps": BLOCKS * block_bytes / med["memcpy"] / 1e9,
                    "ratio": med["memcpy"] / med["pdhal"],
                    "c_loop_ratio": med["memcpy"] / med["C loop"],
                }
            )
        ops.host_free(dst)
        ops.host_free(src)
    return results


def profile(ops, core) -> dict:
    """Python overhead of one ops.copy_blocks call at 64-byte blocks: fixed and per id."""
    from pdhal import _blocks

    block_bytes, cache_blocks = 64, 1 << 14
    nbytes = block_bytes * cache_blocks
    dst, src = ops.host_alloc(nbytes), ops.host_alloc(nbytes)
    rng = random.Random(3)
    few, many = 1, 1024
    out = {}
    for n in (few, many):
        d_ids, s_ids = rng.sample(range(cache_blocks), n), rng.sample(range(cache_blocks), n)
        parts = {
            "ops.copy_blocks": lambda: ops.copy_blocks(dst, d_ids, src, s_ids, block_bytes),
            "C loop via cffi": lambda: core.copy_blocks(
                0,
                0,
                0,
                dst.address,
                cache_blocks,
                src.address,
                cache_blocks,
                block_bytes,
                d_ids,
                s_ids,
            ),
            "parse ids (block_ids x2)": lambda: (
                _blocks.block_ids(d_ids, "d"),
                _blocks.block_ids(s_ids, "s"),
            ),
            "resolve dst and src": lambda: (
                _blocks.resolve(dst, "dst", writable=True),
                _blocks.resolve(src, "src"),
            ),
            "ids to int64_t[] (ffi.new x2)": lambda: (
                core.ffi.new("int64_t[]", d_ids),
                core.ffi.new("int64_t[]", s_ids),
            ),
        }
        for name, fn in parts.items():
            reps = calibrate(fn)
            out.setdefault(name, {})[n] = statistics.median(per_call(fn, reps) for _ in range(7))
    ops.host_free(dst)
    ops.host_free(src)
    return {
        name: {
            "per_call_us": (t[few] - (t[many] - t[few]) / (many - few) * few) * 1e6,
            "per_id_ns": (t[many] - t[few]) / (many - few) * 1e9,
        }
        for name, t in out.items()
    }


def main() -> None:
    from pdhal import _core, _registry, ops

    os.environ.setdefault("PDHAL_NAMESPACE", f"benchcopy{os.getpid()}")
    os.environ["PDHAL_PLATFORM"] = "cpu"
    _registry.reset()
    results = bench_copies(ops, _core)
    prof = profile(ops, _core)
    if "--json" in sys.argv:
        print(json.dumps({"copies": results, "overhead": prof}, indent=2))
        return
    print(
        f"pdhal.ops.copy_blocks (cpu backend) vs ctypes.memmove, {BLOCKS} blocks per call, "
        f"{CACHE_BYTES >> 20} MiB caches, median of {ROUNDS} interleaved rounds"
    )
    print(
        f"{'block':<40} {'layout':<26} {'copies':>6} {'pdhal us':>9} {'memcpy us':>9} "
        f"{'C loop us':>9} {'ratio':>6} {'C loop':>6}"
    )
    for r in results:
        print(
            f"{r['block']:<40} {r['layout']:<26} {r['copies_per_call']:>6} {r['pdhal_us']:>9.1f} "
            f"{r['memcpy_us']:>9.1f} {r['c_loop_us']:>9.1f} {r['ratio']:>5.2f}x "
            f"{r['c_loop_ratio']:>5.2f}x"
        )
    print("ratio = memcpy time / pdhal time (target >= 0.9x); C loop = the C core alone")
    print()
    print("Python overhead of ops.copy_blocks at 64-byte blocks (copying ~free), fit a + b * ids:")
    for name, p in prof.items():
        print(f"  {name:<32} {p['per_call_us']:7.2f} us per call  {p['per_id_ns']:7.1f} ns per id")


if __name__ == "__main__":
    main()
