"""What the nixl transport adds to the contract (`pytest --pdhal-transport nixl`): the
plugin says what to install when NIXL is missing; a description that is not a nixl
endpoint's is refused; a peer that is gone or stopped when connecting is reported within
the option connect_timeout; links to one peer share its connection; NIXL's progress thread
does not spin a core, and a process that used NIXL exits cleanly."""

from __future__ import annotations

import base64
import importlib.util
import subprocess
import sys
import time

import numpy as np
import pytest
from pdhal_nixl._transport import NixlTransport

import pdhal
from pdhal import InvalidArgumentError, TransferError
from pdhal.testing.transfer_peers import Decode
from pdhal.transfer import transport


def test_the_plugin_says_what_to_install_when_nixl_is_missing(monkeypatch):
    from pdhal_nixl import plugin

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'pdhal-nixl\[nixl\]'"):
        plugin.pdhal_transport()


@pytest.fixture
def peer():
    decode = Decode("nx-peer", "nixl")
    yield decode
    decode.resume()
    if decode.proc.returncode is None:
        decode.close()


@pytest.fixture
def source():
    return np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()


def _sources(array: np.ndarray) -> list[tuple[int, int]]:
    return [(array.ctypes.data, array.nbytes)]


@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda d: d.pop("metadata"), "not a nixl endpoint's description: 'metadata'"),
        (lambda d: d.update(metadata="not base64!"), "not a nixl endpoint's description"),
        (lambda d: d.update(addresses=d["addresses"][:-1]), "addresses for"),
        (lambda d: d.update(regions=[]), "addresses for 0 regions"),
    ],
    ids=["no-metadata", "bad-base64", "addresses", "no-regions"],
)
def test_a_description_that_is_not_a_nixl_endpoints_is_refused(peer, source, spoil, match):
    described = dict(peer.described)
    spoil(described)
    with pytest.raises(InvalidArgumentError, match=match):
        transport("nixl").connect(described, _sources(source))


def test_metadata_of_another_agent_is_refused(peer, source):
    described = dict(peer.described, agent="pdhal-someone-else")
    with pytest.raises(TransferError, match="is pdhal-"):
        transport("nixl").connect(described, _sources(source))


def test_a_dead_peer_is_reported_at_connect(peer, source, namespace):
    peer.kill()
    started = time.monotonic()
    with pytest.raises(TransferError, match="could not"):
        transport("nixl").connect(peer.described, _sources(source))
    assert time.monotonic() - started < 10.0
    removed, left = pdhal.cleanup(namespace)  # what the dead process left: its own memory
    assert left == [] and removed and all(f".{peer.proc.pid}." in p for p in removed)


def test_a_stopped_peer_is_reported_at_connect_within_the_connect_timeout(peer, source):
    nixl = NixlTransport()  # a transport of its own: this process's is configured already
    nixl.configure(connect_timeout=1.5)
    peer.stop()
    started = time.monotonic()
    with pytest.raises(TransferError, match=r"within 1.5 s \(option connect_timeout\)"):
        nixl.connect(peer.described, _sources(source))
    assert time.monotonic() - started < 10.0
    peer.resume()
    link = nixl.connect(peer.described, _sources(source))  # served again
    try:
        link.submit([(source.ctypes.data, 0, 0, 64)]).wait(30.0)
    finally:
        link.close()


def test_links_to_one_peer_share_its_loaded_metadata(peer, source):
    nixl = transport("nixl")
    one = nixl.connect(peer.described, _sources(source))
    two = nixl.connect(peer.described, _sources(source))
    try:
        agent = nixl.engine()
        assert agent._peers[one.target][1] == 2
        one.close()
        two.submit([(source.ctypes.data, 0, 0, 64)]).wait(30.0)
    finally:
        one.close()
        two.close()
    assert agent._peers[two.target][1] == 0 and two.target in agent._idle


def test_a_region_of_device_memory_is_refused():
    class Device:  # the CUDA array interface of a (pretend) device buffer
        __cuda_array_interface__ = {
            "shape": (64,),
            "typestr": "|u1",
            "data": (0x7F0000000000, False),
            "version": 3,
        }

    with pytest.raises(InvalidArgumentError, match="host memory"):
        transport("nixl").endpoint([Device()], "nx-device")


IDLE = """
import sys, time
from pdhal import ops
from pdhal.transfer import transport
buffer = ops.host_alloc(4096)
endpoint = transport("nixl").endpoint([buffer], "nx-idle")
time.sleep(0.5)
started = time.process_time()
time.sleep(2.0)
print(time.process_time() - started, flush=True)
endpoint.close()
ops.host_free(buffer)
"""


def test_an_idle_agent_does_not_spin_a_core_and_its_process_exits_cleanly():
    """NIXL's Python wrapper starts the progress thread with a poll() timeout of 0 (a core
    spun for the process's life); UCX's ib module, idle without RDMA devices, segfaults
    the process at exit."""
    done = subprocess.run([sys.executable, "-c", IDLE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cpu = float(done.stdout.strip().splitlines()[-1])
    assert cpu < 0.5, f"{cpu:.2f} CPU-seconds in 2 idle seconds"


def test_the_description_is_json_able_and_names_the_agent(peer):
    import json

    described = json.loads(json.dumps(peer.described))
    assert described["transport"] == "nixl" and described["agent"].startswith("pdhal-")
    assert base64.b64decode(described["metadata"])
    assert len(described["addresses"]) == len(described["regions"])
