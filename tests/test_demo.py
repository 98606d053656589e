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

from conftest import segments_of
from pdhal_demo.control import DemoError
from pdhal_demo.model import ModelConfig
from pdhal_demo.plan import make_plan
from pdhal_demo.transport import block_runs, require_mooncake

pytestmark = pytest.mark.paddle

SMALL = ["--layers", "4", "--prompt-lens", "64,100,200,333", "--batch", "2",
         "--chunk-tokens", "128", "--decode-steps", "3"]


def demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdhal", "demo", *args], capture_output=True,
                          text=True, timeout=timeout)


def expected_bytes(prompts: list[int], layers: int) -> int:
    """Bytes moved: K and V of every block a prompt fills, every layer."""
    block = ModelConfig().block_bytes()
    return sum(-(-n // 64) for n in prompts) * 2 * layers * block


def token_bytes(prompts: list[int], layers: int) -> int:
    """Bytes verified: K and V of every prompt token, every layer."""
    return sum(prompts) * 2 * layers * ModelConfig().block_bytes() // 64


@pytest.mark.parametrize("transport, extra", [
    ("shm", []), ("shm", ["--shm-copy", "copy_blocks"]),
    ("mooncake", []),  # several layers in flight (asynchronous submission)
    ("mooncake", ["--inflight", "1"]),
], ids=["shm-memmove", "shm-copy_blocks", "mooncake-inflight4", "mooncake-inflight1"])
def test_both_modes_verify_every_byte(transport, extra, tmp_path):
    plot = tmp_path / "timeline.png"
    run = demo(*SMALL, "--mode", "both", "--transport", transport, "--json", "--plot", str(plot),
               *extra)
    assert run.returncode == 0, run.stderr
    summaries = json.loads(run.stdout)
    assert [s["mode"] for s in summaries] == ["per_query", "per_chunk"]
    for s in summaries:
        assert s["ok"] and not s["bad_blocks"] and not s["bad_tokens"]
        assert s["transport"] == transport and s["requests"] == 4 and s["layers"] == 4
        assert s["bytes_moved"] == expected_bytes([64, 100, 200, 333], 4)
        assert s["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)
        assert 0 < s["overlap_efficiency"] <= 1 and s["exposed_transfer_ms"] >= 0
        assert s["causality_violations"] == 0
        assert 0 < s["transfer_busy_s"] <= s["wall_s"]
        assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["max"]
    # per_chunk splits the 200- and 333-token prompts over 128-token steps
    assert summaries[1]["steps"] == -(-(64 + 100 + 200 + 333) // 128)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_figures_keep_their_bounds_with_every_core_busy(transport):
    """Two busy loops compete for the two cores: the worker and the messager get preempted
    anywhere, yet every transfer starts after its layer ended (the worker reads the end
    before it posts the signal), so efficiency <= 1 and exposed transfer >= 0 still hold."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        run = demo(*SMALL, "--mode", "both", "--transport", transport, "--json")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert run.returncode == 0, run.stderr
    for s in json.loads(run.stdout):
        assert s["ok"] and s["causality_violations"] == 0
        assert 0 < s["overlap_efficiency"] <= 1 and s["exposed_transfer_ms"] >= 0


def test_timeline_bounds_hold_for_transfers_in_flight_together():
    """Overlapping transfers (Mooncake's layers in flight) used to sum to more than the time
    they took: the busy time is their union, and each gets its own share of it."""
    from pdhal_demo.report import Timeline

    t = Timeline(start=0)
    t.step_start[0, 1] = 0
    for layer, end in enumerate([10, 20, 30]):
        t.layer_end[0, 1, layer] = end
    # three transfers, each starting right after its layer, each 25 long: they overlap
    t.transfers = [{"rank": 0, "step": 1, "layer": i, "start": 10 * i + 11, "end": 10 * i + 36,
                    "bytes": 1} for i in range(3)]
    assert t.busy() == 56 - 11  # the union, not 3 * 25
    assert t.ideal_end() == 10 + 25 + 10 + 10 == 55  # 10 + each one's share (25, 10, 10)
    assert t.overlap_efficiency() == 55 / 56 <= 1
    assert t.exposed_transfer() == 56 - 30 and t.causality_violations() == 0
    # one at a time, back to back after their layers: the old serial schedule, efficiency 1
    t.transfers = [{"rank": 0, "step": 1, "layer": i, "start": 10 * i + 10,
                    "end": 10 * i + 15, "bytes": 1} for i in range(3)]
    assert t.busy() == 15 and t.ideal_end() == t.measured_end() == 35
    assert t.overlap_efficiency() == 1.0
    # a transfer that seems to start before its layer ended is counted, never hidden
    t.transfers[2]["start"] = 29
    assert t.causality_violations() == 1


@pytest.mark.parametrize("transport, mode", [("shm", "both"), ("mooncake", "per_query")])
def test_tensor_parallel_ranks_each_ship_their_heads_and_decode_verifies_every_byte(transport,
                                                                                     mode):
    run = demo(*SMALL, "--tp", "2", "--mode", mode, "--transport", transport, "--json")
    assert run.returncode == 0, run.stderr
    for s in json.loads(run.stdout):
        assert s["ok"] and s["tp"] == 2 and s["causality_violations"] == 0
        assert s["bytes_moved"] == expected_bytes([64, 100, 200, 333], 4)
        assert s["verified_bytes"] == token_bytes([64, 100, 200, 333], 4)
        # each worker saw only its own device (local 0) and named its channels by its id
        assert [(r["rank"], r["device"]) for r in s["ranks"]] == [(0, 0), (1, 1)]
        assert [r["bytes_moved"] for r in s["ranks"]] == [s["bytes_moved"] // 2] * 2


def test_a_slow_rank_stalls_only_itself():
    """Rank 1's link is slow (each layer's transfer waits 100 ms): its transfers fall behind
    its layers more and more, rank 0's keep pace with theirs (own channels, own messager)."""
    run = demo(*SMALL, "--tp", "2", "--layers", "8", "--mode", "per_query", "--slow-rank",
               "1:100", "--json")
    assert run.returncode == 0, run.stderr
    [s] = json.loads(run.stdout)
    fast, slow = s["ranks"]
    assert s["ok"] and slow["max_start_lag_ms"] > 300 and slow["exposed_transfer_ms"] > 300
    assert fast["max_start_lag_ms"] < slow["max_start_lag_ms"] / 4
    assert fast["exposed_transfer_ms"] < slow["exposed_transfer_ms"] / 4


@pytest.mark.parametrize("transport, mode, requests", [("shm", "per_chunk", 150),
                                                      ("mooncake", "per_query", 100)])
def test_many_requests_recycle_blocks_slots_and_ring_at_a_flat_rate(transport, mode, requests):
    """Far more requests than the caches hold (16 blocks a side) or the batch has slots (4):
    blocks and slots are reused as requests finish, the per-chunk ring (16 steps) wraps
    about a dozen times, every byte is checked before its blocks are released, and the rate
    at which requests reach decode does not fall as the run goes on."""
    run = demo("--layers", "4", "--prompt-lens", "64,100,200,333", "--requests", str(requests),
               "--cache-blocks", "16", "--max-batch", "4", "--batch", "2", "--chunk-tokens",
               "128", "--mode", mode, "--transport", transport, "--json")
    assert run.returncode == 0, run.stderr
    [s] = json.loads(run.stdout)
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
    """The decode side dies mid-step: the messager's next write fails, it says so, the run
    exits non-zero (nothing waits for the transfer timeout)."""
    start = time.monotonic()
    run = demo(*SMALL, "--mode", "per_query", "--layers", "8", "--transport", "mooncake",
               "--fault", "kill-decoder")
    assert run.returncode == 1
    assert "the decoder exited (killed by signal 9); the messager reported it" in run.stderr
    assert "Mooncake's write of layer" in run.stderr
    reported = int(re.search(r"reported it (\d+) ms after the kill", run.stderr).group(1))
    assert reported < 5000
    assert time.monotonic() - start < 60


def test_prompt_bigger_than_the_cache_is_rejected_up_front():
    run = demo(*SMALL, "--mode", "per_query", "--prompt-lens", "64,5000", "--cache-blocks", "16")
    assert run.returncode == 0, run.stderr
    assert ("rejected a 5000-token prompt up front: needs 79 blocks of 64 tokens, the whole "
            "cache has 15 (block 0 is reserved)") in run.stderr
    assert "requests 1 " in run.stdout and "every byte verified" in run.stdout
    run = demo("--prompt-lens", "5000", "--cache-blocks", "16")
    assert run.returncode == 1 and "no request fits the cache" in run.stderr


def _fake_mooncake(tmp_path, error: str) -> str:
    package = tmp_path / "mooncake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(f"raise ImportError({error!r})\n")
    return str(tmp_path)


@pytest.mark.parametrize("error, advice", [
    ("libibverbs.so.1: cannot open shared object file: No such file or directory",
     "install Debian's libibverbs1 (apt-get install libibverbs1)"),
    ("No module named 'mooncake.engine'", "pip install 'pdhal-demo[mooncake]'"),
])
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
    run = subprocess.run([sys.executable, "-m", "pdhal", "demo", *SMALL, "--transport",
                          "mooncake"], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1 and advice in run.stderr


def test_per_chunk_plan_splits_long_prompts_within_the_token_budget():
    plan = make_plan(ModelConfig(layers=2), [64, 300, 50], "per_chunk", "shm", cache_blocks=32,
                     decode_steps=2, batch=4, chunk_tokens=128)
    assert all(sum(c.length for c in step) <= 128 for step in plan.steps)
    for request in plan.requests:
        chunks = [c for step in plan.steps for c in step if c.request == request.id]
        assert [c.start for c in chunks] == list(np.cumsum([0] + [c.length for c in chunks])[:-1])
        assert sum(c.length for c in chunks) == request.prompt_len
    prefill = [b for r in plan.requests for b in r.prefill_blocks]
    decode = [b for r in plan.requests for b in r.decode_blocks]
    assert len(set(prefill)) == len(prefill) and len(set(decode)) == len(decode)
    assert prefill != decode[:len(prefill)]  # placement differs between the two sides


def test_block_runs_pair_only_blocks_consecutive_on_both_sides():
    assert block_runs([0, 1, 2, 5], [10, 11, 3, 4]) == [(0, 10, 2), (2, 3, 1), (5, 4, 1)]


@pytest.mark.parametrize("tp", [1, 2])
def test_verification_catches_one_wrong_byte(tp):
    from pdhal_demo.decoder import TinyDecoder, reference_prefill, verify

    plan = make_plan(ModelConfig(layers=3), [70, 40], "per_query", "shm", cache_blocks=8,
                     decode_steps=2, batch=2, chunk_tokens=0, tp=tp)
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
        plan = make_plan(ModelConfig(layers=2), [70, 40, 130], "per_chunk", "shm",
                         cache_blocks=8, decode_steps=1, batch=3, chunk_tokens=64, tp=tp)
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
    parent = subprocess.Popen([sys.executable, "-m", "pdhal", "demo", *SMALL, "--mode",
                               "per_query", "--transport", "mooncake", "--decoder", "remote",
                               "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        for line in parent.stderr:
            if line.rstrip().endswith("python -m pdhal_demo.child decoder"):
                break
        assignments = line.split(" python -m")[0].split()
        env = dict(os.environ, **dict(a.split("=", 1) for a in assignments))
        assert env["PDHAL_DEMO_HOST"] == "<decode-host-ip>"
        env["PDHAL_DEMO_HOST"] = "127.0.0.1"
        decoder = subprocess.run([sys.executable, "-m", "pdhal_demo.child", "decoder"], env=env,
                                 capture_output=True, timeout=240)
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert decoder.returncode == 0 and parent.returncode == 0, err
    [summary] = json.loads(out)
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
        hub.start("no-such-role", dict(os.environ))
    assert time.monotonic() - start < 30
    hub.stop(grace=1.0)


# -- live progress -------------------------------------------------------------------------

_PROGRESS = re.compile(r"prefilled\s+(\d+) tok, layer\s+(\d+)/\d+ \| sent\s+(\d+) tok, "
                       r"layer\s+(\d+)/\d+")


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

    plan = make_plan(ModelConfig(layers=4), [64, 100, 200, 333], mode, "shm",
                     cache_blocks=64, decode_steps=1, batch=2, chunk_tokens=128)
    worker, messager = [], []
    for index in range(len(plan.steps)):
        step = 7 + index  # channel steps start after the warm-up step
        worker.append(("step", {"rank": 0, "step": step, "index": index, "start": 0}))
        for layer in range(plan.model.layers):
            worker.append(("layer", {"rank": 0, "step": step, "index": index, "layer": layer,
                                     "end": 1, "signal": 2}))
            messager.append(("xfer", {"rank": 0, "step": step, "index": index, "layer": layer,
                                      "start": 3, "end": 4, "bytes": 1}))
    orders = {"messager read first": [1] * len(messager) + [0] * len(worker),
              "worker read first": [0] * len(worker) + [1] * len(messager)}
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
