"""pdhal-nixl's tests (each in a PDHAL_NAMESPACE of its own, nothing left behind: the
pdhal_isolate ini option): UCX on TCP (PDHAL_NIXL_UCX_TLS, inherited by the processes a
test starts): the wire between two hosts. On one host UCX would pick shared memory or CMA,
whose writes land in a stopped process too, which is what the stall tests stop."""

import pytest


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv("PDHAL_NIXL_UCX_TLS", "tcp")
