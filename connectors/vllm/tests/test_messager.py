"""The messager against fake peers, no vLLM: a real `python -m pdhal_vllm.messager` process
between a fake prefill worker in this process (its KV cache in pdhal memory, the worker's
hello over the messager's local socket, its step tables and layer signals on the channel of
its device) and a fake decode worker (pdhal's KVReceiver and DecodeClient). A transfer lands
byte-equal and the worker hears it was sent; a worker of another rank, or a hello that is
not one, is refused naming what is wrong; a transfer the worker abandons fails at once on
the decode side; a process that connects and says nothing, or lacks the key, or sends what
a worker never sends, keeps no worker from being served."""

from __future__ import annotations

import secrets
import socket
import time

import numpy as np
import pytest
from conftest import Cluster
from pdhal_vllm.wire import ConnectorError, connect_worker, worker_address

from pdhal import ops
from pdhal.transfer import CacheLayout, CacheSpec, DecodeClient, KVReceiver

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, BLOCK_BYTES = 2, 8, 4, 2, 256
LAYER_BYTES = BLOCKS * BLOCK_BYTES
DEVICE = 3  # the fake worker's KV cache is on device 3: its channel is named by it


class FakePrefill:
    """A prefill worker as the connector's is, to its messager."""

    def __init__(self, address: str, key: bytes, channel: int = DEVICE, **hello):
        """Its layer signals on device `channel`'s channel; `hello`: what its hello says
        otherwise than a good worker's."""
        self.buffer = ops.host_alloc(LAYERS * LAYER_BYTES)
        self.cache = self.buffer.as_numpy(np.uint8, (LAYERS * LAYER_BYTES,))
        self.cache[:] = np.random.default_rng(7).integers(0, 256, self.cache.size, np.uint8)
        self.name = f"fake-prefill.{secrets.token_hex(4)}"
        ops.set_data_ipc(self.cache, self.name)
        self.device = channel
        self.meta = ops.open_shm_and_get_meta_signal(0, channel)  # before the hello
        said = {
            "rank": 0,
            "ranks": 1,
            "device": self.device,
            "kv_heads": HEADS,
            "cache": self.name,
            "nbytes": self.buffer.nbytes,
            "layers": [
                [[0, i * LAYER_BYTES, BLOCK_BYTES, BLOCK_BYTES, BLOCKS, HEADS]] for i in (0, 1)
            ],
            "tokens_placed": False,
            "block_size": BLOCK_TOKENS,
        }
        try:
            self.link = connect_worker(address, key, said | hello, timeout=30.0)
        except ConnectorError:
            self.free()
            raise

    def answer(self, timeout: float = 30.0) -> tuple:
        message = self.link.receive(timeout)
        assert message is not None, "the messager said nothing"
        return tuple(message)

    def step(self, table: list[dict]) -> None:
        """A forward pass that stores `table`'s requests: its table, then each layer."""
        self.meta = ops.open_shm_and_get_meta_signal(0, self.device)
        self.link.send("table", self.meta.step, table)
        for layer in range(LAYERS):
            ops.signal_layer_ready(ops.init_signal_layerwise(self.meta, layer))

    def block(self, layer: int, block: int) -> bytes:
        start = layer * LAYER_BYTES + block * BLOCK_BYTES
        return bytes(self.cache[start : start + BLOCK_BYTES])

    def close(self) -> None:
        self.link.close()
        self.free()

    def free(self) -> None:
        ops.unset_data_ipc(None, self.name)
        ops.host_free(self.buffer)


class FakeDecode:
    """A decode worker's receiving side."""

    def __init__(self, key: bytes):
        self.buffer = ops.host_alloc(LAYERS * LAYER_BYTES)
        self.cache = self.buffer.as_numpy(np.uint8, (LAYERS * LAYER_BYTES,))
        self.cache[:] = 0
        specs = [
            [CacheSpec(0, i * LAYER_BYTES, BLOCK_BYTES, BLOCK_BYTES, BLOCKS, HEADS)]
            for i in range(LAYERS)
        ]
        self.receiver = KVReceiver(
            CacheLayout([self.cache], specs), f"fake-decode.{secrets.token_hex(4)}"
        )
        self.client = DecodeClient(
            self.receiver, key=key, block_tokens=BLOCK_TOKENS, kv_heads=HEADS
        )

    def outcome(self, tid: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for outcome in self.client.poll(timeout=left):
                if outcome.request_id == tid:
                    return outcome
        pytest.fail(f"no outcome of {tid} within {timeout} s")

    def block(self, layer: int, block: int) -> bytes:
        start = layer * LAYER_BYTES + block * BLOCK_BYTES
        return bytes(self.cache[start : start + BLOCK_BYTES])

    def close(self) -> None:
        self.client.close()
        self.receiver.close()
        ops.host_free(self.buffer)


@pytest.fixture
def messager(tmp_path):
    cluster = Cluster(tmp_path, "", secrets.token_hex(16))
    address = cluster.start_messager()
    yield address, bytes.fromhex(cluster.env["PDHAL_VLLM_KEY"]), cluster
    cluster.stop()


@pytest.fixture
def peers(messager):
    address, key, _ = messager
    prefill = FakePrefill(address, key)
    assert prefill.answer()[0] == "ready"
    decode = FakeDecode(key)
    yield address, prefill, decode
    decode.close()
    prefill.close()


def test_a_transfer_lands_byte_equal_and_the_worker_hears_it_was_sent(peers):
    address, prefill, decode = peers
    decode.client.claim("t1", address, [5, 6], tokens=2 * BLOCK_TOKENS, timeout=30)
    prefill.step([{"tid": "t1", "blocks": [1, 2], "start": 0, "end": 8, "prompt_len": 8}])
    assert decode.outcome("t1").landed
    for layer in range(LAYERS):
        for src, dst in ((1, 5), (2, 6)):
            assert decode.block(layer, dst) == prefill.block(layer, src), (layer, src)
    assert decode.block(0, 4) == bytes(BLOCK_BYTES)  # nothing else was written
    assert prefill.answer() == ("sent", "t1")


def test_a_transfer_the_worker_abandons_fails_at_once_on_the_decode_side(peers):
    address, prefill, decode = peers
    prefill.step([{"tid": "t2", "blocks": [3], "start": 0, "end": 4, "prompt_len": 4}])
    prefill.link.send("abandon", ["t2"])
    started = time.monotonic()
    decode.client.claim("t2", address, [7], tokens=BLOCK_TOKENS, timeout=30)
    outcome = decode.outcome("t2")
    assert not outcome.landed and "vLLM ended the prefill request" in outcome.reason
    assert time.monotonic() - started < 10  # not at the claim's timeout (30 s)
    assert prefill.answer()[0] == "failed"


@pytest.mark.parametrize(
    "hello, said",
    [
        ({"rank": 1, "ranks": 2}, "this messager serves prefill rank 0 of tensor parallelism 1"),
        ({"device": 1 << 20}, "the prefill worker's device must be an int in [0, 1048576), got"),
        ({"device": -1}, "its hello's device must be an int >= 0, got -1"),
        ({"device": "0"}, "its hello's device must be an int >= 0, got '0'"),
        ({"rank": False}, "its hello's rank must be an int >= 0, got False"),
        ({"rank": None}, "its hello's rank must be an int >= 0, got None"),
        ({"cache": "x" * 300}, "its hello's cache must be a name of 1-255 characters"),
        ({"layers": "all"}, "its hello's layers must be a list of lists, got 'all'"),
        ({"layers": [[[0, 0, 64]]]}, "the prefill worker's layer 0 must be [region, offset"),
        ({"tokens_placed": 1}, "its hello's tokens_placed must be true or false, got 1"),
    ],
)
def test_a_worker_the_messager_cannot_serve_is_refused_naming_why(messager, hello, said):
    address, key, _ = messager
    worker = FakePrefill(address, key, **hello)
    try:
        kind, why = worker.answer()
        assert kind == "error" and said in why, why
    finally:
        worker.close()


def assert_served(address: str, key: bytes) -> None:
    """A worker connecting now is served (not refused as a second worker of the rank)."""
    good = FakePrefill(address, key)
    try:
        assert good.answer()[0] == "ready"
    finally:
        good.close()


ENTRY = {"tid": "t", "blocks": [1], "start": 0, "end": 4, "prompt_len": 4}


@pytest.mark.parametrize(
    "garbage",
    [
        b"not json",
        b"42",
        b'["exited", 1]',
        b'{"k": 1}',
        b'["table", -1, []]',
        b'["table", 1, [{"tid": 5}]]',
        b'["table", 1, [%s]]' % str(ENTRY | {"blocks": [1.5]}).replace("'", '"').encode(),
        b'["abandon", "t"]',
        b'["table", 1, [%s]]' % str(ENTRY | {"end": 0}).replace("'", '"').encode(),
        b'["table", 1, [%s]]' % str(ENTRY | {"prompt_len": 0}).replace("'", '"').encode(),
        b"[" * 100000 + b"]" * 100000,
    ],
    ids=[
        "unreadable",
        "not-a-list",
        "an-internal-event",
        "a-dict",
        "a-negative-step",
        "an-entry-without-fields",
        "a-fractional-block",
        "tids-not-a-list",
        "no-token-written",
        "an-empty-prompt",
        "nested-past-the-stack",
    ],
)
def test_a_worker_that_sends_garbage_is_dropped_and_the_next_is_served(messager, garbage):
    """A served worker whose next message is not one a worker sends: its connection ends
    (the messager's reader lived on and marked it gone), and a worker connecting after it
    is served, not refused as a second worker of the rank."""
    address, key, _ = messager
    bad = FakePrefill(address, key)
    try:
        assert bad.answer()[0] == "ready"
        bad.link._frames.write(garbage, 5.0)  # (bytes no WorkerLink would send)
        with pytest.raises(ConnectorError, match="closed"):
            bad.answer()  # the messager closed it
    finally:
        bad.close()
    assert_served(address, key)


def test_a_silent_process_or_one_without_the_key_keeps_no_worker_from_being_served(messager):
    """A local process that connects and says nothing holds its own connection only (each
    is authenticated apart, within its bound); one without the key is refused."""
    address, key, _ = messager
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(worker_address(address))
    try:
        with pytest.raises(ConnectorError, match="did not take this worker"):
            FakePrefill(address, bytes(16))
        worker = FakePrefill(address, key)  # while the silent one is still connected
        try:
            assert worker.answer()[0] == "ready"
            assert silent.recv(1 << 10)  # its challenge: it too was answered, apart
        finally:
            worker.close()
    finally:
        silent.close()


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--claim-timeout", "nan"], "--claim-timeout must be a number of seconds in (0, 86400]"),
        (["--keepalive", "-1"], "--keepalive must be a number of seconds in (0, 86400]"),
        (["--rank", "2", "--prefill-tp", "2"], "--rank must be in [0, 2)"),
        (["--transport", "carrier-pigeon"], "transport 'carrier-pigeon' is not installed"),
    ],
)
def test_a_messager_started_with_a_bad_flag_says_which_and_exits(argv, said, capsys):
    """At its start, not at the first worker's hello (which it would refuse, each time)."""
    from pdhal_vllm.messager import main

    assert main(["--auth-key", "00" * 16, *argv]) == 1
    assert said in capsys.readouterr().err


def test_a_table_of_a_step_given_already_drops_that_worker_and_the_next_is_served(messager):
    """A second table for one step is a broken worker: the messager ends it (its transfers
    fail) rather than keep a table that every later layer signal trips on."""
    address, key, _ = messager
    bad = FakePrefill(address, key)
    try:
        assert bad.answer()[0] == "ready"
        bad.link.send("table", 7, [ENTRY])
        bad.link.send("table", 7, [ENTRY | {"tid": "u"}])
        while True:  # its transfers' ends, then the close
            with pytest.raises(ConnectorError, match="closed"):
                assert bad.answer()[0] == "failed"
                continue
            break
    finally:
        bad.close()
    assert_served(address, key)


def test_a_worker_that_reads_nothing_holds_up_no_one_else(messager):
    """A table whose every entry fails at once (its blocks are outside the cache) makes one
    "failed" per entry for a worker that never reads them: they queue for that worker
    alone, and another process's hello is answered meanwhile, not after the send bound."""
    address, key, _ = messager
    deaf = FakePrefill(address, key)
    try:
        assert deaf.answer()[0] == "ready"
        entries = [ENTRY | {"tid": f"t{i:05}", "blocks": [10**6]} for i in range(5000)]
        deaf.link.send("table", 1, entries)
        started = time.monotonic()
        other = FakePrefill(address, key)
        try:
            assert other.answer()[0] == "error"  # "already serves": it was heard
            assert time.monotonic() - started < 10  # (the send bound is 15 s)
        finally:
            other.close()
    finally:
        deaf.close()
