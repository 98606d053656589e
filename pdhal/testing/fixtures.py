"""What a test suite of code built on pdhal puts around its tests, as pdhal's own suites do
(the core's, each backend's, the demo's, the vLLM connector's). In the pytest configuration
(pyproject.toml's [tool.pytest.ini_options], or pytest.ini):

    pdhal_isolate = true

gives every test a PDHAL_NAMESPACE of its own and fails one that leaves a segment behind
(the `namespace` fixture here, autouse; pdhal's pytest plugin loads it); the functions run
code in real child processes and count threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from pdhal._backends import registry as _registry
from pdhal.testing.reset import release_process_state, remove_leftovers, segments_of

__all__ = [
    "install_distributions",
    "namespace",
    "python_child",
    "run_child",
    "segments_of",
    "thread_count",
    "thread_count_settled",
]


@pytest.fixture(autouse=True)
def namespace(monkeypatch):
    """Every test runs in its own PDHAL_NAMESPACE and must leave no segment behind."""
    ns = f"t{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("PDHAL_NAMESPACE", ns)
    monkeypatch.delenv("PDHAL_PLATFORM", raising=False)
    monkeypatch.delenv("PDHAL_PLUGINS", raising=False)
    _registry.reset()
    yield ns
    release_process_state()
    left = remove_leftovers(ns)  # removed, so one failure does not cascade; then fail
    assert not left, f"segments left behind: {left}"


def python_child(code: str, *, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start `code` (dedented) in a fresh Python process with this test's environment."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ) if env is None else env,
        **kwargs,
    )


def run_child(
    code: str, timeout: float = 120, env: dict | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """Run `code` in a child process; fail the test (showing its output) unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ) if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def install_distributions(target, *sources) -> dict[str, str]:
    """pip-install each source folder as its own distribution into the folder `target` (no
    dependencies, no build isolation); returns this environment with `target` first on
    PYTHONPATH (prepended: a run against a scratch copy of pdhal, make mutate, keeps its own
    pdhal on the path)."""
    for source in sources:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                str(target),
                str(source),
            ],
            check=True,
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return env


def thread_count() -> int:
    """This process's threads, as the kernel lists them."""
    return len(os.listdir("/proc/self/task"))


def thread_count_settled(expected: int, timeout: float = 2.0) -> int:
    """The thread count once it reaches `expected`, or after `timeout`.

    pthread_join returns when the kernel clears the thread's tid, a moment before
    the task leaves /proc/self/task; under ASan or load that moment is long enough to see.
    """
    deadline = time.monotonic() + timeout
    while (count := thread_count()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count
