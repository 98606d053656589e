"""Fixtures of the conformance suite: the selected backend's TestSupport, a namespace per
test (nothing may be left in /dev/shm), and child processes with the same environment."""

from __future__ import annotations

import os
import uuid

import pytest

from pdhal import _names, _published, _registry, _signals


@pytest.fixture(autouse=True)
def namespace(monkeypatch, support):
    ns = f"kit{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("PDHAL_NAMESPACE", ns)
    yield ns
    support.release()
    _signals.close_producer_channels()
    _published.unpublish_all()
    for reader in list(_signals._chunk_readers.values()):
        reader.close()
    _signals._chunk_readers.clear()
    prefix = f"pdhal.{os.geteuid()}.{ns}."
    left = [n for n in os.listdir(_names.shm_dir()) if n.startswith(prefix)]
    for name in left:
        os.unlink(os.path.join(_names.shm_dir(), name))
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
