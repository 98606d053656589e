"""Fixtures of the conformance suite: the selected backend's TestSupport, a namespace per
test (nothing may be left in /dev/shm), and child processes with the same environment."""

from __future__ import annotations

import uuid

import pytest

from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.testing.reset import release_process_state, remove_leftovers


@pytest.fixture(autouse=True)
def namespace(monkeypatch, support):
    ns = f"kit{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("PDHAL_NAMESPACE", ns)
    streams = [None]  # the default stream, and every stream the test took
    take_stream = support.stream
    monkeypatch.setattr(support, "stream", lambda: streams.append(take_stream()) or streams[-1])
    yield ns
    # A signal queued on a stream holds its channel until it ran: wait for the test's device
    # work before judging what was left behind.
    for stream in streams:
        ops.synchronize(stream)
    support.release()
    release_process_state(forget_backend=False)
    left = remove_leftovers(ns)
    assert not left, f"segments left behind: {left}"


@pytest.fixture(scope="session")
def backend(pdhal_backend_name):
    _registry.reset()
    selection = _registry.selection()
    assert selection.candidate.name == pdhal_backend_name
    return selection.candidate.backend


@pytest.fixture(scope="session")
def support(backend):
    support = backend.test_support()
    if support is None:
        pytest.fail(f"backend {backend.name!r} provides no TestSupport (Backend.test_support)")
    return support
