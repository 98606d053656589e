"""`pdhal demo` end to end: three real processes, every received byte checked.

These run the real Paddle model (small: a few layers, short prompts) and the real
transports: `shm`, and Mooncake's transfer engine over TCP on loopback (installed by
`make test` with Debian's libibverbs1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from pdhal_demo.control import DemoError, require_mooncake
from pdhal_demo.model import ModelConfig
from pdhal_demo.plan import make_plan

from pdhal.testing.fixtures import segments_of

pytestmark = pytest.mark.paddle

SMALL = [
    "--layers",
    "4",
    "--prompt-lens",
    "64,100,200,333",
    "--batch",
    "2",
    "--chunk-tokens",
    "128",
    "--decode-steps",
    "3",
]


def demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdhal", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def runs_of(stdout: str) -> list[dict]:
    """The runs `pdhal demo --json` printed: stdout holds one JSON object and nothing else
    (json.loads refuses anything after it), with the versions it was made by."""
    import pdhal

    printed = json.loads(stdout)
    assert set(printed) == {"pdhal_version", "backend", "schema_version", "runs"}, printed
    assert printed["schema_version"] == 2 and printed["pdhal_version"] == pdhal.__version__
    assert printed["backend"] == pdhal.current_backend()
    return printed["runs"]


def expected_bytes(prompts: list[int], layers: int) -> int:
    """Bytes moved: K and V of every block a prompt fills, every layer."""
    block = ModelConfig().block_bytes()
    return sum(-(-n // 64) for n in prompts) * 2 * layers * block


def token_bytes(prompts: list[int], layers: int) -> int:
    """Bytes verified: K and V of every prompt token, every layer."""
    return sum(prompts) * 2 * layers * ModelConfig().block_bytes() // 64


@pytest.mark.parametrize(
    "transport, extra",
    [
        ("shm", []),
        ("mooncake", []),  # several layers in flight (asynchronous submission)
        ("mooncake", ["--inflight", "1"]),
    ],
    ids=["shm", "mooncake-inflight4", "mooncake-inflight1"],
)
def test_both_modes_verify_every_byte_with_every_core_busy(transport, extra, tmp_path):
    """Busy loops compete for every core: the worker and the messager get preempted
    anywhere, yet every byte lands and every transfer starts after its layer ended (the
    worker reads the end before it posts the signal), so efficiency <= 1 and exposed
    transfer >= 0 still hold."""
    plot = tmp_path / "timeline.png"
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        run = demo(
            *SMALL,
            "--mode",
            "both",
            "--transport",
            transport,
            "--json",
            "--plot",
            str(plot),
            *extra,
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert run.returncode == 0, run.stderr
    summaries = runs_of(run.stdout)
    assert [s["mode"] for s in summaries] == ["per_query", "per_chunk"]
    for s in summaries:
        assert s["ok"] and not s["bad_blocks"] and not s["bad_tokens"]
        assert s["transport"] == transport and s["requests"] == 4 and s["layers"] == 4
        assert s["bytes_moved"] == expected_bytes([64, 100, 200, 333], 4)
        assert s["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)
        assert 0 <= s["overlap_efficiency_p1"] <= s["overlap_efficiency_p50"] <= 1
        assert 0 <= s["exposed_ms_p50"] <= s["exposed_ms_p99"]
        assert s["causality_violations"] == 0
        assert 0 < s["transfer_busy_s"] <= s["wall_s"]
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["max"]
    # per_chunk splits the 200- and 333-token prompts over 128-token steps
    assert summaries[1]["steps"] == -(-(64 + 100 + 200 + 333) // 128)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_followed_steps_verify_every_byte():
    """--follow: each step is one PrefillService.follow, the shm link starting each layer's
    copies at its signal; every byte verified, the transfers overlapping the forward."""
    run = demo(*SMALL, "--mode", "per_query", "--transport", "shm", "--follow", "--json")
    assert run.returncode == 0, run.stderr
    [s] = runs_of(run.stdout)
    assert s["ok"] and not s["bad_blocks"] and not s["bad_tokens"]
    assert s["bytes_moved"] == expected_bytes([64, 100, 200, 333], 4)
    assert s["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)
    assert s["causality_violations"] == 0
    assert 0 <= s["overlap_efficiency_p1"] <= s["overlap_efficiency_p50"] <= 1


@pytest.mark.simulated
@pytest.mark.parametrize(
    "prefill, decode, block, order",
    [
        ("xpu", "cuda", 16, "heads"),
        ("cuda", "xpu", 48, "heads"),
        ("cuda", "cpu", 128, "heads"),
        ("cpu", "xpu", 32, "tokens"),
    ],
    ids=[
        "xpu-to-cuda-blocks-of-16",
        "cuda-to-xpu-blocks-of-48",
        "cuda-to-cpu-blocks-of-128",
        "cpu-to-xpu-token-major-blocks-of-32",
    ],
)
def test_a_prefill_and_a_decode_on_two_backends_and_block_sizes_verify_every_byte(
    monkeypatch, prefill, decode, block, order
):
    """Simulated runtimes (no GPU or XPU here): the workers and messagers on one backend,
    the decoder on another (--decode-platform), each cache in pinned host memory of its
    own backend's runtime, shared by name over shm; decode blocks of `block` tokens
    (48 and 64 divide neither the other; 128 holds two prefill blocks), head-major as the
    prefill's or token-major (converted on the way). Each side says what it ran on, and
    every prompt token's K and V, every layer, is checked against a recomputation in the
    decoder's own blocks; its decode tokens against a plain run's."""
    from pdhal_cuda.testing import CudaTestSupport
    from pdhal_xpu.testing import XpuTestSupport

    monkeypatch.setenv("PDHAL_CUDART", CudaTestSupport.simulator())
    monkeypatch.setenv("PDHAL_XPURT", XpuTestSupport.simulator())
    monkeypatch.setenv("PDHAL_PLATFORM", prefill)
    args = ["--decode-platform", decode, "--decode-block-size", str(block)]
    args += ["--decode-order", order]
    run = demo("--mode", "per_chunk", "--json", *args, *SMALL)
    assert run.returncode == 0, run.stderr
    (summary,) = json.loads(run.stdout)["runs"]
    assert summary["sides"] == {
        "prefill": {"backend": prefill, "block_tokens": 64, "order": "heads"},
        "decode": {"backend": decode, "block_tokens": block, "order": order},
    }
    assert summary["ok"], (summary["bad_blocks"][:3], summary["bad_tokens"][:3])
    assert summary["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)


def test_a_decode_block_size_plans_the_decode_tables_in_its_own_blocks():
    """Decode blocks of 16 tokens: each request's decode table holds its prompt and the
    tokens it decodes in 16-token blocks (block 0 kept unused), as many tokens of cache as
    the prefill's 64-token blocks; a prompt the decode cache cannot hold is refused, naming
    both sides' blocks."""
    plan = make_plan(
        ModelConfig(layers=2), [100, 16, 17], "per_query", "shm", 4, 3, 4, 512, decode_block_size=16
    )
    assert plan.decode_cache_blocks == 16 and plan.decode_block_size == 16
    assert [len(r.prefill_blocks) for r in plan.requests] == [2, 1, 1]
    assert [len(r.decode_blocks) for r in plan.requests] == [7, 2, 2]  # 103, 19, 20 tokens
    assert [len(plan.decode_prompt_blocks(r.id)) for r in plan.requests] == [7, 1, 2]
    used = [b for r in plan.requests for b in r.decode_blocks]
    assert 0 not in used and len(set(used)) == len(used) and max(used) < 16
    (refused,) = make_plan(
        ModelConfig(layers=2), [250], "per_query", "shm", 4, 3, 4, 512, decode_block_size=16
    ).rejected
    assert refused == (
        250,
        "needs 16 blocks of 16 tokens to decode, the cache has 15 (block 0 is reserved)",
    )


def test_timeline_busy_time_is_the_union_of_transfers_in_flight_together():
    """Overlapping transfers (Mooncake's layers in flight) used to sum to more than the time
    they took: the busy time is their union (pdhal.transfer's busy_ns)."""
    from pdhal_demo.report import Timeline

    t = Timeline(start=0)
    t.step_start[0, 1] = 0
    for layer, end in enumerate([10, 20, 30]):
        t.layer_end[0, 1, layer] = end
    # three transfers, each starting right after its layer, each 25 long: they overlap
    t.transfers = [
        {"rank": 0, "step": 1, "layer": i, "start": 10 * i + 11, "end": 10 * i + 36, "bytes": 1}
        for i in range(3)
    ]
    assert t.busy() == 56 - 11  # the union, not 3 * 25
    assert t.causality_violations() == 0
    # a transfer that seems to start before its layer ended is counted, never hidden
    t.transfers[2]["start"] = 29
    assert t.causality_violations() == 1


def test_per_request_figures_are_pdhal_transfer_s_from_the_worker_s_signal():
    """Per request: exposed = landed - the worker's time for its last layer's signal, and
    overlap = the share of first submit -> landed before it, by TransferMetrics' own
    functions; layer-wise and signalled at the end read far apart."""
    from pdhal_demo import report

    from pdhal.transfer import TransferMetrics

    plan = make_plan(
        ModelConfig(layers=3),
        [70, 40],
        "per_query",
        "shm",
        cache_blocks=16,
        decode_steps=1,
        batch=2,
        chunk_tokens=64,
    )
    plan, t = _synthetic_run(plan)  # layer-wise: each layer 10 ms, its transfer right after
    rows = report.request_figures(t, plan)
    assert [(x["rank"], x["request"]) for x in rows] == [(0, 0), (0, 1)]
    last = t.signalled[0, 1, 2]
    for x in rows:
        first, landed = t.landed[0, x["request"]]
        assert x["exposed_ns"] == TransferMetrics.exposed_ns(last, landed) == 502_000
        assert x["overlap_efficiency"] == TransferMetrics.overlap_efficiency(first, last, landed)
    figures = report.overlap_figures(rows)
    assert figures["exposed_ms_p50"] == figures["exposed_ms_p99"] == 0.502
    assert figures["overlap_efficiency_p50"] == 19_998_000 / 20_500_000  # 20 ms of 20.5 before
    # the same transfers, every layer signalled after the forward pass: none before it
    for layer in range(3):
        t.signalled[0, 1, layer] = t.layer_end[0, 1, 2]
    for request, (_, landed) in list(t.landed.items()):
        t.landed[request] = (t.layer_end[0, 1, 2] + 2_000, landed + 1_000_000)
    figures = report.overlap_figures(report.request_figures(t, plan))
    assert figures["overlap_efficiency_p50"] == figures["overlap_efficiency_p1"] == 0.0
    assert figures["exposed_ms_p50"] == 1.502


@pytest.mark.parametrize("transport, mode", [("shm", "both"), ("mooncake", "per_query")])
def test_tensor_parallel_ranks_each_ship_their_heads_and_decode_verifies_every_byte(
    transport, mode
):
    run = demo(*SMALL, "--tp", "2", "--mode", mode, "--transport", transport, "--json")
    assert run.returncode == 0, run.stderr
    for s in runs_of(run.stdout):
        assert s["ok"] and s["tp"] == 2 and s["causality_violations"] == 0
        assert s["bytes_moved"] == expected_bytes([64, 100, 200, 333], 4)
        assert s["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)
        # each worker saw only its own device (local 0) and named its channels by its id
        assert [(r["rank"], r["device"]) for r in s["ranks"]] == [(0, 0), (1, 1)]
        assert [r["bytes_moved"] for r in s["ranks"]] == [s["bytes_moved"] // 2] * 2


def test_a_slow_rank_stalls_only_itself():
    """Rank 1's link is slow (each layer's transfer waits 100 ms): its transfers fall behind
    its layers more and more, rank 0's keep pace with theirs (own channels, own messager)."""
    run = demo(
        *SMALL,
        "--tp",
        "2",
        "--layers",
        "8",
        "--mode",
        "per_query",
        "--slow-rank",
        "1:100",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    [s] = runs_of(run.stdout)
    fast, slow = s["ranks"]
    assert s["ok"] and slow["max_start_lag_ms"] > 300 and slow["exposed_ms_p99"] > 300
    assert fast["max_start_lag_ms"] < slow["max_start_lag_ms"] / 4
    assert fast["exposed_ms_p99"] < slow["exposed_ms_p99"] / 4


def test_signalling_after_the_forward_pass_reads_as_exposed_not_overlapped():
    """The same run with every layer signalled after the forward pass (--signal-at-end):
    per request, nothing of the transfer lay before the last signal and all of it is
    exposed, where layer by layer most of it lay before. The share is compared, not the
    two runs' exposed milliseconds: on a loaded machine a small run's whole copy after the
    forward took 1.9 ms where the layer-wise run's last layer took 3.4 ms (CI-like load)."""
    runs = {}
    for how, extra in (("layer-wise", []), ("at-end", ["--signal-at-end"])):
        run = demo(*SMALL, "--layers", "8", "--mode", "per_query", "--json", *extra)
        assert run.returncode == 0, run.stderr
        [runs[how]] = runs_of(run.stdout)
    lw, end = runs["layer-wise"], runs["at-end"]
    figures = {
        how: {k: v for k, v in s.items() if k.startswith(("exposed", "overlap"))}
        for how, s in runs.items()
    }
    assert end["layer_signals"] == "after the forward pass", figures
    assert end["overlap_efficiency_p50"] <= 0.3 < 0.6 <= lw["overlap_efficiency_p50"], figures


@pytest.mark.parametrize(
    "transport, mode, requests", [("shm", "per_chunk", 150), ("mooncake", "per_query", 100)]
)
def test_many_requests_recycle_blocks_slots_and_ring_at_a_flat_rate(transport, mode, requests):
    """Far more requests than the caches hold (16 blocks a side) or the batch has slots (4):
    blocks and slots are reused as requests finish, the per-chunk ring (16 steps) wraps
    about a dozen times, every byte is checked before its blocks are released, and the rate
    at which requests reach decode does not fall as the run goes on."""
    run = demo(
        "--layers",
        "4",
        "--prompt-lens",
        "64,100,200,333",
        "--requests",
        str(requests),
        "--cache-blocks",
        "16",
        "--max-batch",
        "4",
        "--batch",
        "2",
        "--chunk-tokens",
        "128",
        "--mode",
        mode,
        "--transport",
        transport,
        "--json",
    )
    assert run.returncode == 0, run.stderr
    [s] = runs_of(run.stdout)
    prompts = [[64, 100, 200, 333][i % 4] for i in range(requests)]
    assert s["ok"] and s["recycled_blocks"] and s["requests"] == requests
    assert s["bytes_moved"] == expected_bytes(prompts, 4) > 10 * 16 * 2 * 4 * 32768
    assert s["verified_bytes"] == token_bytes(prompts, 4)
    if mode == "per_chunk":
        assert s["steps"] >= 12 * 16
    rates = [w["requests_per_s"] for w in s["throughput_windows"]]
    assert len(rates) == 10
    # flat: the last tenths go as fast as the first ones (start-up aside), give or take noise
    assert sum(rates[-3:]) >= 0.5 * sum(rates[1:4]), rates


def test_human_output_shows_progress_and_summary():
    run = demo(*SMALL, "--mode", "per_chunk")
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "on decode at" in line]
    assert len(lines) == 4  # one progress line per request, when it is on decode: all sent
    for line, prompt in zip(lines, [64, 100, 200, 333]):
        assert _positions(line) == ((prompt, 4), (prompt, 4)), line
    assert "every byte verified, decode tokens match the reference" in run.stdout
    assert "overlap efficiency" in run.stdout and "time to first token" in run.stdout
    assert "exposed transfer per request" in run.stdout


@pytest.mark.parametrize("mode", ["per_query", "per_chunk"])
def test_killed_messager_is_reported_by_the_worker(mode):
    start = time.monotonic()
    run = demo(*SMALL, "--mode", mode, "--layers", "8", "--fault", "kill-messager")
    assert run.returncode == 1
    assert "the messager exited (killed by signal 9); the worker reported it" in run.stderr
    assert "the cache messager (pid" in run.stderr and "died" in run.stderr
    assert time.monotonic() - start < 60


def test_killed_worker_is_reported_by_the_messager_and_its_segments_reclaimed(namespace):
    run = demo(*SMALL, "--mode", "per_chunk", "--layers", "8", "--fault", "kill-worker")
    assert run.returncode == 1
    assert "the worker exited (killed by signal 9); the messager reported it" in run.stderr
    assert "ProducerDiedError" in run.stderr
    assert not segments_of(namespace)  # what the killed worker created is gone too


def test_killed_decoder_fails_the_messager_s_mooncake_writes_at_once():
    """The decode side dies mid-step: the messager's session with it closes (or its next
    write fails), it says so, the run exits non-zero (nothing waits for the transfer
    timeout)."""
    start = time.monotonic()
    run = demo(
        *SMALL,
        "--mode",
        "per_query",
        "--layers",
        "8",
        "--transport",
        "mooncake",
        "--fault",
        "kill-decoder",
    )
    assert run.returncode == 1
    assert "the decoder exited (killed by signal 9); the messager reported it" in run.stderr
    # its session's end (the connection closed, or reset) or its next write says it first
    written = r"a write of \d+ bytes to \S+ (failed|timed out|did not land)"
    session = (
        r"its decode side's session ended: "
        r"(the peer closed the connection|the connection failed|a send failed)"
    )
    assert re.search(f"{written}|{session}", run.stderr), run.stderr
    reported = int(re.search(r"reported it (\d+) ms after the kill", run.stderr).group(1))
    assert reported < 5000
    assert time.monotonic() - start < 60


def test_prompt_bigger_than_the_cache_is_rejected_up_front():
    run = demo(*SMALL, "--mode", "per_query", "--prompt-lens", "64,5000", "--cache-blocks", "16")
    assert run.returncode == 0, run.stderr
    assert (
        "rejected a 5000-token prompt up front: needs 79 blocks of 64 tokens to prefill, the "
        "cache has 16; 79 blocks of 64 tokens to decode, the cache has 15 (block 0 is "
        "reserved)"
    ) in run.stderr
    assert "requests 1 " in run.stdout and "every byte verified" in run.stdout
    run = demo("--prompt-lens", "5000", "--cache-blocks", "16")
    assert run.returncode == 1 and "no request fits the cache" in run.stderr


def _fake_mooncake(tmp_path, error: str) -> str:
    package = tmp_path / "mooncake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(f"raise ImportError({error!r})\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    "error, advice",
    [
        (
            "libibverbs.so.1: cannot open shared object file: No such file or directory",
            "install Debian's libibverbs1 (apt-get install libibverbs1)",
        ),
        ("No module named 'mooncake.engine'", "pip install 'pdhal-demo[mooncake]'"),
    ],
)
def test_missing_mooncake_says_what_to_install(tmp_path, monkeypatch, error, advice):
    fake = _fake_mooncake(tmp_path, error)
    monkeypatch.syspath_prepend(fake)
    for name in [m for m in sys.modules if m.startswith("mooncake")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with pytest.raises(DemoError, match=re.escape(advice)):
            require_mooncake()
    finally:  # the fake package must not stay imported for the tests after this one
        for name in [m for m in sys.modules if m.startswith("mooncake")]:
            del sys.modules[name]
    env = dict(os.environ, PYTHONPATH=fake)
    run = subprocess.run(
        [sys.executable, "-m", "pdhal", "demo", *SMALL, "--transport", "mooncake"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 1 and advice in run.stderr


def test_per_chunk_plan_splits_long_prompts_within_the_token_budget():
    plan = make_plan(
        ModelConfig(layers=2),
        [64, 300, 50],
        "per_chunk",
        "shm",
        cache_blocks=32,
        decode_steps=2,
        batch=4,
        chunk_tokens=128,
    )
    assert all(sum(c.length for c in step) <= 128 for step in plan.steps)
    for request in plan.requests:
        chunks = [c for step in plan.steps for c in step if c.request == request.id]
        assert [c.start for c in chunks] == list(np.cumsum([0] + [c.length for c in chunks])[:-1])
        assert sum(c.length for c in chunks) == request.prompt_len
    prefill = [b for r in plan.requests for b in r.prefill_blocks]
    decode = [b for r in plan.requests for b in r.decode_blocks]
    assert len(set(prefill)) == len(prefill) and len(set(decode)) == len(decode)
    assert prefill != decode[: len(prefill)]  # placement differs between the two sides


@pytest.mark.parametrize("tp", [1, 2])
def test_verification_catches_one_wrong_byte(tp):
    from pdhal_demo.decoder import TinyDecoder, reference_prefill, verify

    plan = make_plan(
        ModelConfig(layers=3),
        [70, 40],
        "per_query",
        "shm",
        cache_blocks=8,
        decode_steps=2,
        batch=2,
        chunk_tokens=0,
        tp=tp,
    )
    cache = np.zeros((tp, *plan.model.cache_shape(plan.decode_cache_blocks, tp)), np.float32)
    first = reference_prefill(TinyDecoder(plan.model, tp), plan, cache)
    clean = verify(plan, cache.copy(), first)
    assert not clean["bad_blocks"] and not clean["bad_tokens"]
    request = plan.requests[1]
    cache.view(np.uint8)[tp - 1, 2, 1, request.decode_blocks[0], 0, 5, 0] ^= 1  # layer 2's V
    bad = verify(plan, cache, first)
    assert bad["bad_blocks"] == [{"request": 1, "rank": tp - 1, "layer": 2, "kv": "V"}]


def test_tensor_parallel_ranks_sum_to_the_single_rank_model():
    """tp ranks each compute their heads and MLP units; summed in rank order they give the
    same first tokens as one rank computing everything (and the same K/V, split by heads)."""
    from pdhal_demo.decoder import TinyDecoder, reference_prefill

    caches, tokens = {}, {}
    for tp in (1, 2, 4):
        plan = make_plan(
            ModelConfig(layers=2),
            [70, 40, 130],
            "per_chunk",
            "shm",
            cache_blocks=8,
            decode_steps=1,
            batch=3,
            chunk_tokens=64,
            tp=tp,
        )
        cache = np.zeros((tp, *plan.model.cache_shape(8, tp)), np.float32)
        tokens[tp] = reference_prefill(TinyDecoder(plan.model, tp), plan, cache)
        # [tp, layers, 2, blocks, heads/tp, ...] -> [layers, 2, blocks, heads, ...]
        caches[tp] = np.concatenate(list(cache), axis=3)
    assert tokens[1] == tokens[2] == tokens[4]
    np.testing.assert_allclose(caches[2], caches[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(caches[4], caches[1], rtol=1e-4, atol=1e-5)


def test_decoder_started_by_hand_elsewhere_connects_with_the_printed_command():
    """--decoder remote: the decode receiver is started from the command the demo prints, as
    on another host (loopback stands in for the network here; Mooncake carries the blocks)."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdhal",
            "demo",
            *SMALL,
            "--mode",
            "per_query",
            "--transport",
            "mooncake",
            "--decoder",
            "remote",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in parent.stderr:
            if line.rstrip().endswith("python -m pdhal_demo.child decoder"):
                break
        assignments = line.split(" python -m")[0].split()
        env = dict(os.environ, **dict(a.split("=", 1) for a in assignments))
        assert env["PDHAL_DEMO_HOST"] == "<decode-host-ip>"
        env["PDHAL_DEMO_HOST"] = "127.0.0.1"
        decoder = subprocess.run(
            [sys.executable, "-m", "pdhal_demo.child", "decoder"],
            env=env,
            capture_output=True,
            timeout=240,
        )
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert decoder.returncode == 0 and parent.returncode == 0, err
    [summary] = runs_of(out)
    assert summary["ok"] and summary["transport"] == "mooncake"
    assert summary["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)


def test_remote_decoder_needs_mooncake():
    run = demo("--decoder", "remote")
    assert run.returncode == 2 and "--decoder remote needs --transport mooncake" in run.stderr


def test_a_child_that_dies_before_connecting_is_reported_not_waited_on():
    from pdhal_demo.control import Hub

    hub = Hub()
    start = time.monotonic()
    with pytest.raises(DemoError, match="the no-such-role exited before it connected"):
        hub.launch("no-such-role", dict(os.environ))
        hub.accept("no-such-role", 30.0)
    assert time.monotonic() - start < 30
    hub.stop(grace=1.0)


def test_a_wait_for_a_process_that_never_connects_ends_at_its_deadline():
    """No process to watch (a remote decoder): the wait ends by its deadline, saying so."""
    from pdhal_demo.control import Hub

    hub = Hub()
    start = time.monotonic()
    with pytest.raises(DemoError, match="the decoder did not connect within 1 s"):
        hub.accept("decoder", 1.0)
    assert 1.0 <= time.monotonic() - start < 30
    hub.stop(grace=1.0)


# -- checks before the run: one line, the right exit status, no process started ----------

#: `pdhal demo ARGS` in a parent that records every demo process it starts (its role, in a
#: file) and where the modules named are not installed (`import` fails, find_spec: None).
RECORDED = """
import subprocess, sys
blocked, record, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
for name in filter(None, blocked.split(",")):
    sys.modules[name] = None
class Recorded(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        if "pdhal_demo.child" in args:
            with open(record, "a") as log:
                log.write(args[-1] + "\\n")
        super().__init__(args, *rest, **kwargs)
subprocess.Popen = Recorded
from pdhal._tools.cli import main
sys.exit(main(argv))
"""


def recorded_demo(tmp_path, *args: str, blocked=(), env=None):
    """(the finished `pdhal demo ARGS`, the roles of the processes it started)."""
    record = tmp_path / "started"
    run = subprocess.run(
        [sys.executable, "-c", RECORDED, ",".join(blocked), str(record), "demo", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=None if env is None else dict(os.environ, **env),
        check=False,
    )
    return run, record.read_text().split() if record.exists() else []


def test_json_is_one_object_and_the_plot_any_format_matplotlib_writes(tmp_path, namespace):
    """The positive side of the checks below: the recording parent does see the processes
    start, prints one JSON object, and writes an SVG plot (its format from the name)."""
    plot = tmp_path / "timeline.svg"
    run, started = recorded_demo(
        tmp_path, *SMALL, "--mode", "per_query", "--json", "--plot", str(plot)
    )
    assert run.returncode == 0, run.stderr
    assert started == ["decoder", "worker", "messager"]
    [s] = runs_of(run.stdout)
    assert s["mode"] == "per_query" and s["ok"]
    assert plot.read_text().lstrip().startswith("<?xml") and "<svg" in plot.read_text()
    assert not segments_of(namespace)


@pytest.mark.parametrize(
    "args, blocked, env, status, says",
    [
        (
            ["--plot", "{tmp}/no/such/folder/timeline.png"],
            (),
            None,
            2,
            "/no/such/folder does not exist; create it, or give a path in an existing folder",
        ),
        (["--plot", "{tmp}"], (), None, 2, "is a folder: give a file name, such as"),
        (
            ["--plot", "/proc/timeline.png"],
            (),
            None,
            2,  # nobody, root neither, creates files there
            "--plot /proc/timeline.png: cannot create a file in /proc",
        ),
        (
            ["--plot", "{tmp}/timeline.pgn"],
            (),
            None,
            2,
            "matplotlib cannot write '.pgn' files; end the name in .png, .pdf or .svg",
        ),
        (["--plot", "{tmp}/timeline"], (), None, 2, "the file name has no extension"),
        (
            ["--plot", "{tmp}/timeline.png"],
            ("matplotlib",),
            None,
            1,
            "--plot needs matplotlib, which cannot be imported",
        ),
        ([], ("paddle",), None, 1, "Paddle is not installed: pip install paddlepaddle"),
        (["--transport", "mooncake"], ("mooncake",), None, 1, "pip install 'pdhal-demo[mooncake]'"),
        (
            [],
            (),
            {"PDHAL_BACKPRESSURE_TIMEOUT": "abc"},
            1,
            (
                "PDHAL_BACKPRESSURE_TIMEOUT: must be a positive number of seconds, got 'abc'; "
                "fix or unset it"
            ),
        ),
        (["--decoder", "remote"], (), None, 2, "--decoder remote needs --transport mooncake"),
        (
            ["--decode-platform", "tpu"],
            (),
            None,
            1,
            "--decode-platform tpu: PDHAL_PLATFORM: no backend 'tpu' is installed",
        ),
        (["--follow"], (), None, 2, "--follow needs --mode per_query and --transport shm"),
    ],
    ids=[
        "plot-folder-missing",
        "plot-is-a-folder",
        "plot-folder-unwritable",
        "plot-format",
        "plot-no-extension",
        "no-matplotlib",
        "no-paddle",
        "no-mooncake",
        "bad-PDHAL-variable",
        "usage",
        "decode-platform-not-installed",
        "follow-both-modes",
    ],
)
def test_what_the_run_needs_is_checked_before_any_process_starts(
    tmp_path, namespace, args, blocked, env, status, says
):
    """Each failed check: one line `pdhal: error: ...` that says what to do, exit status 2
    (usage) or 1 (environment), and no demo process started, no segment made."""
    args = [a.format(tmp=tmp_path) for a in args]
    run, started = recorded_demo(tmp_path, *SMALL, *args, blocked=blocked, env=env)
    assert started == [], f"a child process was started: {started}\n{run.stderr}"
    assert run.returncode == status, run.stderr
    assert run.stderr.startswith("pdhal: error: ") and run.stderr.count("\n") == 1, run.stderr
    assert says in run.stderr, run.stderr
    assert run.stdout == ""
    assert not segments_of(namespace)
    assert not list(tmp_path.glob("timeline*"))


# -- the picture ---------------------------------------------------------------------------


def _synthetic_run(plan):
    """A timeline as the pipeline records it for `plan` (rank 0, 10 ms a layer, each
    signal 1 µs after its layer, each transfer 0.5 ms; a request landed as its last
    transfer ended, its first submit its first step's first transfer; on decode 1 ms
    after)."""
    from pdhal_demo.report import Timeline

    t, now = Timeline(start=1_000_000), 1_000_000
    for index, step in enumerate(plan.steps):
        t.step_start[0, index + 1] = now
        t.step_index[0, index + 1] = index
        for layer in range(plan.model.layers):
            now += 10_000_000
            t.layer_end[0, index + 1, layer] = now
            t.signal[0, index + 1, layer] = now + 1_000
            t.signalled[0, index + 1, layer] = now
            t.transfers.append(
                {
                    "rank": 0,
                    "step": index + 1,
                    "index": index,
                    "layer": layer,
                    "start": now + 2_000,
                    "end": now + 502_000,
                    "bytes": 1,
                }
            )
        first = now - (plan.model.layers - 1) * 10_000_000 + 2_000
        for c in step:
            t.landed.setdefault((0, c.request), (first, 0))
            if c.start + c.length == plan.request(c.request).prompt_len:
                t.landed[0, c.request] = (t.landed[0, c.request][0], now + 502_000)
                t.inserted[c.request] = now + 1_502_000
    return plan, t


def _requests_named(label: str) -> set[int]:
    """ "r0–r2, r5" -> {0, 1, 2, 5}."""
    out = set()
    for part in label.split(", "):
        first, _, last = part.partition("–")
        out |= set(range(int(first[1:]), int((last or first)[1:]) + 1))
    return out


def test_timeline_figure_says_what_each_colour_and_tick_is(tmp_path):
    from matplotlib.collections import LineCollection
    from pdhal_demo import report

    plans = [
        make_plan(
            ModelConfig(layers=3),
            [70, 40, 130],
            mode,
            "shm",
            cache_blocks=16,
            decode_steps=1,
            batch=2,
            chunk_tokens=64,
        )
        for mode in ("per_query", "per_chunk")
    ]
    runs = [_synthetic_run(plan) for plan in plans]
    fig = report.figure(runs)
    [legend] = fig.legends
    said = " | ".join(text.get_text() for text in legend.get_texts())
    for what in (
        "compute: the worker runs one layer",
        "(colour: which layer)",
        "transfer: the messager copies that layer's KV blocks to decode",
        "layer signal: posted by the worker through pdhal",
        "rN: request N is in the decode cache",
        "step k: a prefill step starts",
    ):
        assert what in said, said
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().split(":")[0] for ax in panels] == [
        "per_query over shm",
        "per_chunk over shm",
    ]
    [bar] = [ax for ax in fig.axes if "layer" in ax.get_ylabel()]
    assert bar.get_ylabel().startswith("layer (the colour of its compute and transfer bars)")
    for ax, (plan, t) in zip(panels, runs):
        assert ax.get_xlabel() == "time since the prefill worker started (ms)"
        assert [label.get_text() for label in ax.get_yticklabels()] == [
            "worker: compute",
            "layer signal",
            "messager: transfer",
            "decode: request\nin its cache",
        ]
        notes = [text.get_text() for text in ax.texts]
        steps = [n.partition(": ") for n in notes if n.startswith("step ")]
        assert [(head, _requests_named(ids)) for head, _, ids in steps] == [
            (f"step {i}", {c.request for c in step}) for i, step in enumerate(plan.steps)
        ]
        arrivals = [_requests_named(n) for n in notes if n.startswith("r")]
        assert sorted(r for group in arrivals for r in group) == [0, 1, 2]
        [ticks] = [c for c in ax.collections if isinstance(c, LineCollection)]
        assert len(ticks.get_segments()) == len(t.signal)  # a tick per layer signal
        assert sorted(seg[0][0] for seg in ticks.get_segments()) == sorted(
            (at - t.start) / 1e6 for at in t.signal.values()
        )
    report.plot(runs, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- live progress -------------------------------------------------------------------------

_PROGRESS = re.compile(
    r"prefilled\s+(\d+) tok, layer\s+(\d+)/\d+ \| sent\s+(\d+) tok, "
    r"layer\s+(\d+)/\d+"
)


def _positions(line: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """((prefilled tokens, layers), (sent tokens, layers)) of a progress line."""
    ct, cl, st, sl = map(int, _PROGRESS.search(line).groups())
    return (ct, cl), (st, sl)


@pytest.mark.parametrize("mode", ["per_query", "per_chunk"])
def test_progress_never_shows_a_request_sent_ahead_of_its_prefill(mode):
    """The parent reads the worker's and the messager's events on two connections, in
    whatever order they come: a transfer of layer L is often read before the worker's
    event for layer L. Every order must give lines with sent <= prefilled, ending full."""
    import random

    from pdhal_demo.pipeline import Options, Pipeline

    plan = make_plan(
        ModelConfig(layers=4),
        [64, 100, 200, 333],
        mode,
        "shm",
        cache_blocks=64,
        decode_steps=1,
        batch=2,
        chunk_tokens=128,
    )
    worker, messager = [], []
    for index in range(len(plan.steps)):
        step = 7 + index  # channel steps start after the warm-up step
        worker.append(("step", {"rank": 0, "step": step, "index": index, "start": 0}))
        for layer in range(plan.model.layers):
            worker.append(
                (
                    "layer",
                    {
                        "rank": 0,
                        "step": step,
                        "index": index,
                        "layer": layer,
                        "end": 1,
                        "signal": 2,
                    },
                )
            )
            messager.append(
                (
                    "xfer",
                    {
                        "rank": 0,
                        "step": step,
                        "index": index,
                        "layer": layer,
                        "start": 3,
                        "end": 4,
                        "bytes": 1,
                    },
                )
            )
    orders = {
        "messager read first": [1] * len(messager) + [0] * len(worker),
        "worker read first": [0] * len(worker) + [1] * len(messager),
    }
    for seed in range(20):
        order = [0] * len(worker) + [1] * len(messager)
        random.Random(seed).shuffle(order)
        orders[f"shuffled {seed}"] = order
    for name, order in orders.items():
        pipeline = Pipeline(plan, Options(progress=False))
        try:
            queues = [list(worker), list(messager)]
            handlers = [pipeline._on_worker, pipeline._on_messager]
            for source in order:
                handlers[source](*queues[source].pop(0))
                for request in plan.requests:
                    line = pipeline.progress.line(request)
                    prefilled, sent = _positions(line)
                    assert sent <= prefilled, f"{name}: {line}"
            for request in plan.requests:
                full = (request.prompt_len, plan.model.layers)
                assert _positions(pipeline.progress.line(request)) == (full, full), name
        finally:
            pipeline.hub.stop(grace=0)
