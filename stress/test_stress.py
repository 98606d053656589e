"""10,000,000 signals through each channel kind between two processes: none lost, memory
flat. Run by `make stress` (CI runs it after `make test`; not part of the quick suite);
prints RSS before and after."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

TOTAL = int(os.environ.get("PDHAL_STRESS_SIGNALS", "10000000"))
LAYERS = 100
STEPS = TOTAL // LAYERS

RSS = """
def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
"""

PRODUCER = {
    "per_query": f"""
        from pdhal import ops
        for step in range({STEPS}):
            meta = ops.open_shm_and_get_meta_signal(0, 0)
            for layer in range({LAYERS}):
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
            if step == {STEPS} // 100:
                before = rss_kib()
        print(before, rss_kib(), flush=True)
        import time; time.sleep(1)
    """,
    "per_chunk": f"""
        from pdhal import ops
        for step in range(1, {STEPS} + 1):
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, {LAYERS})
            for layer in range({LAYERS}):
                ops.signal_layer_ready(chunk.layer(layer))
            if step == {STEPS} // 100:
                before = rss_kib()
        print(before, rss_kib(), flush=True)
    """,
}

READER = {
    "per_query": f"""
        from pdhal import ops
        reader = ops.open_kv_signal_reader(0, 0, timeout=60)
        since, seen = (0, -1), 0
        while since != ({STEPS}, {LAYERS - 1}):
            now = reader.wait(since, timeout=60)
            assert now > since and now[1] < {LAYERS}, (since, now)
            since, seen = now, seen + 1
            if seen == 1000:
                before = rss_kib()
        print(before, rss_kib(), seen, flush=True)
    """,
    "per_chunk": f"""
        import array
        from pdhal import ops
        out = array.array("i", [0] * 1538)
        reader = ops.open_kv_chunk_reader(0, 0, timeout=60)
        for step in range(1, {STEPS} + 1):
            for layer in range({LAYERS}):
                assert reader.next(out, timeout=60) == step
                assert out[1] == layer and out[4] == step, (step, layer, list(out[:5]))
            if step == {STEPS} // 100:
                before = rss_kib()
        print(before, rss_kib(), {TOTAL}, flush=True)
    """,
}


def _start(code: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RSS + textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("mode", ["per_query", "per_chunk"])
def test_ten_million_signals(mode):
    env = dict(os.environ, PDHAL_NAMESPACE=f"stress{uuid.uuid4().hex[:8]}")
    producer = _start(PRODUCER[mode], env)
    reader = _start(READER[mode], env)
    r_out, _ = reader.communicate(timeout=1800)
    p_out, _ = producer.communicate(timeout=60)
    assert reader.returncode == 0 and producer.returncode == 0
    p_before, p_after = map(int, p_out.split())
    r_before, r_after, seen = map(int, r_out.split())
    print(
        f"\n{mode}: {TOTAL} signals; reader observed {seen}; RSS KiB producer "
        f"{p_before} -> {p_after}, reader {r_before} -> {r_after}"
    )
    assert p_after - p_before < 8192 and r_after - r_before < 8192  # flat: < 8 MiB growth
    leftovers = [n for n in os.listdir("/dev/shm") if env["PDHAL_NAMESPACE"] in n]
    assert not leftovers
