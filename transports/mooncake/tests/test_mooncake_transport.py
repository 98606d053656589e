"""What the mooncake transport adds to the contract (`pytest --pdhal-transport mooncake`):
completion at the target only, so a Mooncake before 0.3.12 (its TCP writes completed once
in the local socket), MC_TCP_PROTO=1 (Mooncake's switch back to that framing) and a
destination that does not describe the acknowledged framing are refused, naming the
versions; an endpoint describes its own; a garbage description is refused at connect."""

from __future__ import annotations

import numpy as np
import pytest
from pdhal_mooncake import _transport

from pdhal import InvalidArgumentError, TransferError
from pdhal.testing.transfer_peers import Decode
from pdhal.transfer import require_target_completion, transport


@pytest.mark.parametrize(
    "version, acknowledged",
    [
        ("0.3.12", True),
        ("0.3.12.post1", True),
        ("0.3.13.post1", True),
        ("0.4.0+cu12", True),
        ("1.0", True),
        ("0.3.11.post1", False),
        ("0.3.11", False),
        ("0.3.12rc1", False),
        ("0.3.12.dev3", False),
        ("0.3.9", False),
        ("", False),
        (None, False),
        (12, False),
    ],
)
def test_the_acknowledged_framing_is_mooncake_0_3_12_and_later(version, acknowledged):
    assert _transport.acknowledged(version) is acknowledged


def test_the_transport_declares_completion_at_the_target():
    assert _transport.MooncakeTransport.completion == "target"
    require_target_completion(transport("mooncake"))


@pytest.mark.parametrize(
    "installed, match",
    [
        (("mooncake-transfer-engine", "0.3.11.post1"), r"Mooncake 0\.3\.11\.post1 \("),
        (("", ""), "pip knows no Mooncake here"),
    ],
    ids=["old", "unknown"],
)
def test_an_engine_refuses_a_mooncake_without_the_acknowledged_framing(
    monkeypatch, installed, match
):
    monkeypatch.setattr(_transport, "_installed", lambda: installed)
    with pytest.raises(TransferError, match=match) as refused:
        _transport._Engine("127.0.0.1", "tcp")
    assert "pip install -U 'mooncake-transfer-engine>=0.3.12'" in str(refused.value)


def test_an_engine_refuses_mc_tcp_proto_1(monkeypatch):
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(TransferError, match="MC_TCP_PROTO=1 is set in this process"):
        _transport._Engine("127.0.0.1", "tcp")


def test_a_protocol_without_completion_at_the_target_is_refused_where_it_is_given(monkeypatch):
    fresh = _transport.MooncakeTransport()
    with pytest.raises(InvalidArgumentError, match=r"option protocol='nvlink': it takes one of"):
        fresh.configure(protocol="nvlink")
    monkeypatch.setenv("PDHAL_MOONCAKE_PROTOCOL", "nvlink")
    with pytest.raises(InvalidArgumentError, match=r"PDHAL_MOONCAKE_PROTOCOL='nvlink': .*'tcp'"):
        fresh.endpoint([np.zeros(64, np.uint8)], "mc-refused")


def test_the_options_given_rule_over_the_environment_and_bind_once_used(monkeypatch):
    monkeypatch.setenv("PDHAL_MOONCAKE_HOST", "127.0.0.2")
    fresh = _transport.MooncakeTransport()
    fresh.configure(host="127.0.0.1")
    buffer = np.zeros(64, np.uint8)
    endpoint = fresh.endpoint([buffer], "mc-configured")
    try:
        assert endpoint.describe()["session"].startswith("127.0.0.1:")
        fresh.configure(host="127.0.0.1")  # the same again: nothing to change
        with pytest.raises(InvalidArgumentError, match=r"in use already with host='127.0.0.1'"):
            fresh.configure(host="127.0.0.3")
    finally:
        endpoint.close()


@pytest.fixture
def peer():
    decode = Decode("mc-peer", "mooncake")
    yield decode
    decode.close()


@pytest.fixture
def source():
    return np.zeros(4096, np.uint8)


def _sources(array: np.ndarray) -> list[tuple[int, int]]:
    return [(array.ctypes.data, array.nbytes)]


def test_an_endpoint_describes_its_mooncake_and_framing(peer):
    _, installed = _transport._installed()
    assert peer.described["mooncake"] == installed
    assert peer.described["protocol"] == "tcp"
    assert peer.described["tcp_proto_version"] == 2


@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda d: d.update(mooncake="0.3.11.post1"), r"runs Mooncake 0\.3\.11\.post1 "),
        (lambda d: d.update(tcp_proto_version=1), r"\(TCP framing 1\)"),
        (lambda d: d.pop("tcp_proto_version"), r"\(TCP framing None\)"),
        (lambda d: d.pop("mooncake"), "a Mooncake it does not name"),
        (lambda d: d.update(protocol="rdma"), "over 'rdma', this side over 'tcp'"),
    ],
    ids=["old", "framing-1", "no-framing", "no-version", "rdma"],
)
def test_a_destination_without_the_acknowledged_framing_is_refused(peer, source, spoil, match):
    described = dict(peer.described)
    spoil(described)
    with pytest.raises(TransferError, match=match) as refused:
        transport("mooncake").connect(described, _sources(source))
    if "rdma" not in match:  # both versions named
        assert f"this side Mooncake {_transport._installed()[1]}" in str(refused.value)


def test_mc_tcp_proto_1_set_once_the_engine_runs_is_refused_at_connect(peer, source, monkeypatch):
    """Mooncake reads MC_TCP_PROTO at each transfer, not once."""
    transport("mooncake").connect(peer.described, _sources(source)).close()
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(TransferError, match="MC_TCP_PROTO=1 is set here"):
        transport("mooncake").connect(peer.described, _sources(source))


@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda d: d.update(addresses=d["addresses"][:-1]), "lists 6 values for 7 regions"),
        (lambda d: d.update(addresses=[-1] * 7), r"addresses\[0\]"),
        (lambda d: d.update(addresses=[str(a) for a in d["addresses"]]), r"addresses\[0\]"),
        (lambda d: d.update(session=7), "session must be 'host:port'"),
        (lambda d: d.pop("regions"), "not a mooncake endpoint's description: 'regions'"),
    ],
    ids=["count", "negative", "str", "session", "no-regions"],
)
def test_a_garbage_description_is_refused_at_connect(peer, source, spoil, match):
    described = dict(peer.described)
    spoil(described)
    with pytest.raises(InvalidArgumentError, match=match):
        transport("mooncake").connect(described, _sources(source))
