"""Shared fixtures: a unique namespace per test (nothing may be left in /dev/shm), a fresh
backend selection, and helpers to run code in real child processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from pdhal import _published, _registry, _signals

HERE = os.path.dirname(os.path.abspath(__file__))


def segments_of(namespace: str) -> list[str]:
    prefix = f"pdhal.{os.geteuid()}.{namespace}."
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


@pytest.fixture(autouse=True)
def namespace(monkeypatch):
    """Every test runs in its own PDHAL_NAMESPACE and must leave no segment behind."""
    ns = f"t{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("PDHAL_NAMESPACE", ns)
    monkeypatch.delenv("PDHAL_PLATFORM", raising=False)
    monkeypatch.delenv("PDHAL_PLUGINS", raising=False)
    _registry.reset()
    yield ns
    _signals.close_producer_channels()
    _published.unpublish_all()
    for reader in list(_signals._chunk_readers.values()):
        reader.close()
    _signals._chunk_readers.clear()
    _registry.reset()
    left = segments_of(ns)
    for name in left:  # clean up so one failure does not cascade, then fail
        os.unlink(os.path.join("/dev/shm", name))
    assert not left, f"segments left behind: {left}"


def python_child(code: str, *, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start `code` (dedented) in a fresh Python process with this test's environment."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            env=dict(os.environ) if env is None else env, **kwargs)


def run_child(code: str, timeout: float = 120, env: dict | None = None,
              **kwargs) -> subprocess.CompletedProcess:
    """Run `code` in a child process; fail the test (showing its output) unless it exits 0."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=dict(os.environ) if env is None else env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc
