"""The connector's configuration refused where it is given: kv_connector_extra_config's
keys and its transport options, and the messager's --transport-option."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from pdhal_vllm.metadata import config
from pdhal_vllm.wire import ConnectorError


def _vllm(extra: dict):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_the_extra_config_fills_its_defaults():
    extra = config(_vllm({"transport": "mooncake", "transport_options": {"host": "10.0.0.2"}}))
    assert extra["transport_options"] == {"host": "10.0.0.2"}
    assert extra["load_mode"] == "async" and extra["messager"] is None


@pytest.mark.parametrize(
    "given, match",
    [
        ({"transprot": "shm"}, r"no key 'transprot': it takes messager, transport, "),
        ({"mooncake_host": "10.0.0.2"}, r"settings go in transport_options"),
        ({"transport_options": ["host=x"]}, r"transport_options must be a JSON object"),
        ({"load_mode": "eager"}, r"load_mode must be 'async' or 'sync'"),
    ],
)
def test_a_wrong_extra_config_is_refused_naming_what_is_wrong(given, match):
    with pytest.raises(ConnectorError, match=match):
        config(_vllm(given))


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
