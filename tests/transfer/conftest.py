"""Fixtures of the pdhal.transfer tests: a decode process, this process bound to a
simulated runtime, and the test-only `faulty` transport (tests/plugins/transports)
installed for this process."""

from __future__ import annotations

import os

import pytest
from pdhal_cuda.testing import CudaTestSupport
from pdhal_xpu.testing import XpuTestSupport
from simulators import SimRuntime

import pdhal
from pdhal._backends import registry as _registry
from pdhal._transfer import plugins as _transports
from pdhal.testing.fixtures import install_distributions
from pdhal.testing.transfer_peers import Decode

PLUGIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "transports"
)


@pytest.fixture
def decode():
    """A decode process holding a KVReceiver over shm (transfer_peers.Decode)."""
    d = Decode()
    yield d
    if d.proc.returncode is None:
        d.close()


@pytest.fixture
def bind(monkeypatch):
    """bind(backend): this process bound to `backend`'s simulated runtime, its transports
    made afresh for it (both undone after the test)."""

    def bound(backend: str):
        monkeypatch.setenv("PDHAL_PLATFORM", backend)
        monkeypatch.setenv("PDHAL_CUDART", CudaTestSupport.simulator())
        monkeypatch.setenv("PDHAL_XPURT", XpuTestSupport.simulator())
        _registry.reset()
        _transports.forget()
        assert pdhal.current_backend() == backend
        return SimRuntime(backend)

    yield bound
    _transports.forget()
    _registry.reset()


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    target = tmp_path_factory.mktemp("transports")
    install_distributions(target, PLUGIN)
    return target


@pytest.fixture
def faulty(plugin_path, monkeypatch):
    """This process sees the `faulty` transport: faulty(FAULTS) names the faults and gives
    its module (to gate or record its batches)."""
    monkeypatch.syspath_prepend(str(plugin_path))
    _transports.forget()
    import pdhal_faulty_transport

    def faults(named: str):
        monkeypatch.setenv("PDHAL_FAULTY_TRANSPORT", named)
        return pdhal_faulty_transport

    yield faults
    _transports.forget()
