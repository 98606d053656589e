"""The connector's configuration refused where it is given: kv_connector_extra_config's
keys and its transport options, and the messager's --transport-option; the
kv-transfer-config built in one place is one vLLM takes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pdhal_vllm.config import extra_config, idle_spin_advice, kv_transfer_config
from pdhal_vllm.wire import ConnectorError


def test_the_extra_config_fills_its_defaults():
    extra = extra_config({"transport": "mooncake", "transport_options": {"host": "10.0.0.2"}})
    assert extra["transport_options"] == {"host": "10.0.0.2"}
    assert extra["load_mode"] == "async" and extra["messager"] is None


@pytest.mark.parametrize(
    "given, match",
    [
        ({"transprot": "shm"}, r"no key 'transprot': it takes messager, transport, "),
        ({"mooncake_host": "10.0.0.2"}, r"settings go in transport_options"),
        ({"transport_options": ["host=x"]}, r"transport_options must be a JSON object"),
        ({"load_mode": "eager"}, r"load_mode must be 'async' or 'sync'"),
        ({"transport_options": {1: "x"}}, r"transport_options must be a JSON object"),
        ({"messager": 5}, r"messager must be 'HOST:PORT', got 5"),
        ({"messager": "127.0.0.1"}, r"an address is HOST:PORT"),
        ({"transport": ""}, r"transport must be a non-empty string"),
        ({"auth_key": 5}, r"auth_key must be a non-empty string, got 5"),
        ({"load_timeout_s": float("nan")}, r"load_timeout_s must be a number of seconds"),
        ({"load_timeout_s": -1}, r"load_timeout_s must be a number of seconds"),
        ({"keepalive_s": "5"}, r"keepalive_s must be a number of seconds in \(0, 86400\]"),
        ({"idle_wait_s": 2}, r"idle_wait_s must be seconds in \[0, 1\] \(0: never wait\)"),
        ({"idle_wait_s": float("nan")}, r"idle_wait_s must be seconds in \[0, 1\]"),
    ],
)
def test_a_wrong_extra_config_is_refused_naming_what_is_wrong(given, match):
    with pytest.raises(ConnectorError, match=match):
        extra_config(given)


def test_the_kv_transfer_config_is_one_vllm_takes():
    from vllm.config import KVTransferConfig

    built = kv_transfer_config("kv_consumer", "recompute", transport="shm", load_mode="sync")
    taken = KVTransferConfig(**built)
    assert taken.kv_connector == "PdhalConnector" and taken.is_kv_consumer
    assert taken.kv_load_failure_policy == "recompute"
    assert taken.kv_connector_extra_config == {"transport": "shm", "load_mode": "sync"}


@pytest.mark.parametrize(
    "args, match",
    [
        (("kv_both",), r"kv_role must be one of kv_producer, kv_consumer, got 'kv_both'"),
        (("kv_producer", "retry"), r"failure_policy must be one of fail, recompute"),
    ],
)
def test_a_wrong_kv_transfer_config_is_refused_where_it_is_built(args, match):
    with pytest.raises(ConnectorError, match=match):
        kv_transfer_config(*args)
    with pytest.raises(ConnectorError, match="no key 'messenger'"):
        kv_transfer_config("kv_producer", messenger="127.0.0.1:1")


@pytest.mark.parametrize(
    "option, said",
    [
        ("host=10.0.0.2", "transport 'shm' takes no options, got host"),
        ("host", "a transport option is KEY=VALUE, got 'host'"),
    ],
)
def test_the_messager_refuses_a_transport_option_at_start(option, said):
    done = subprocess.run(
        [sys.executable, "-m", "pdhal_vllm.messager", "--transport", "shm"]
        + ["--transport-option", option],
        env=dict(os.environ, PDHAL_VLLM_KEY="00" * 16),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and said in done.stderr, done.stderr


@pytest.mark.parametrize(
    "executor, world_size, spins",
    [("mp", 1, True), ("uni", 1, False), ("mp", 2, False), ("ray", 1, False)],
)
def test_a_decode_instance_whose_engine_core_would_spin_is_told_what_to_run(
    executor, world_size, spins
):
    """One worker in a process of its own: the engine core spins on vLLM's queue while
    requests wait for KV (bench_decode_idle), and the advice names the options that stop it."""
    advice = idle_spin_advice(executor, world_size)
    assert (advice is not None) == spins
    if spins:
        assert "--distributed-executor-backend uni" in advice
        assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in advice
