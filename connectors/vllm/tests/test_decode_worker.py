"""The decode half of a worker (pdhal_vllm.decode_worker.DecodeWorker) on a stand-in for the
worker it belongs to, no engine, claiming from a real prefill service in another process
(pdhal.testing.session_peers): a step vLLM scheduled nothing in waits for a load to land
instead of returning into another empty step (the engine steps while any request waits for
its KV), and returns as soon as one did; such a wait is bounded by idle_wait_s; a step that
computed something never waits."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pdhal_vllm.config import extra_config
from pdhal_vllm.decode_worker import DecodeWorker
from pdhal_vllm.metadata import PdhalConnectorMetadata
from pdhal_vllm.wire import Tracer
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pdhal import ops
from pdhal.testing.session_peers import BLOCK_TOKENS, HEAD_BYTES, KEY, KV_HEADS, LAYERS, Peer
from pdhal.testing.session_peers import _caches as session_caches

TOKENS = 2 * BLOCK_TOKENS


@pytest.fixture
def prefill():
    peer = Peer("prefill")
    [address] = peer.read("listening")
    yield peer, address
    peer.close()


@pytest.fixture
def decode():
    layout, _, _ = session_caches(0, 1, HEAD_BYTES, fill=False)
    worker = SimpleNamespace(
        extra=extra_config({"idle_wait_s": 1.0}),
        cache_layout=lambda: layout,
        cache_name="pdhal-vllm.test-decode",
        key=KEY,
        block_size=BLOCK_TOKENS,
        kv_heads=KV_HEADS,
        rank=0,
        ranks=1,
        num_layers=LAYERS,
        trace=Tracer(None),
    )
    half = DecodeWorker(worker)
    yield half
    half.shutdown()
    for region in layout.memory:
        ops.host_free(region)


def load(tid: str, address: str, blocks: list[int]) -> PdhalConnectorMetadata:
    spec = {"req": f"req-{tid}", "tid": tid, "sync": False, "blocks": blocks}
    return PdhalConnectorMetadata(
        loads=[spec | {"first_token": 0, "num_tokens": TOKENS, "messager": address}]
    )


def step(decode: DecodeWorker, idle: bool) -> tuple[KVConnectorTransferResults, float]:
    out = KVConnectorTransferResults()
    started = time.monotonic()
    decode.results(out, idle=idle)
    return out, time.monotonic() - started


def test_an_idle_step_returns_once_a_load_landed_and_a_busy_step_never_waits(prefill, decode):
    service, address = prefill
    decode.idle_wait = 60.0  # a wait that ends sooner ended because the load landed
    decode.start_load(load("t1", address, [5, 2]))
    out, took = step(decode, idle=False)
    assert not out.finished_recving and took < 30  # (waiting would take 60 s)
    service.send("add", "t1", [1, 3], TOKENS)
    out, took = step(decode, idle=True)
    assert out.finished_recving == {"req-t1"} and not out.failed_recving
    assert took < 30


def test_an_idle_step_waits_no_longer_than_idle_wait_s(prefill, decode):
    _, address = prefill
    decode.start_load(load("t2", address, [4, 6]))  # never added: it cannot land
    out, took = step(decode, idle=True)
    assert not out.finished_recving and took >= decode.idle_wait  # 1 s: the fixture's


def test_an_idle_step_without_loads_does_not_wait(decode):
    decode.idle_wait = 60.0
    out, took = step(decode, idle=True)
    assert not out.finished_recving and took < 30
