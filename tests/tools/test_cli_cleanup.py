"""`pdhal cleanup` removes only what it is asked to: dead segments of the namespace named
(--namespace), none with --dry-run (it lists them), and nothing when an option is
mistyped (the command refuses to run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdhal import ops
from pdhal._protocol import names as _names
from pdhal.testing.fixtures import run_child

DIE_HOLDING = (
    "import os; from pdhal import ops; ops.open_shm_and_get_meta_signal(5, 0); os._exit(0)"
)


def _dead_segment(namespace: str) -> str:
    """The path of a per-query channel whose producer died, in `namespace`."""
    run_child(DIE_HOLDING, env=dict(os.environ, PDHAL_NAMESPACE=namespace))
    path = os.path.join(_names.shm_dir(), f"pdhal.{os.geteuid()}.{namespace}.query.r5.d0")
    assert os.path.exists(path)
    return path


def _cleanup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdhal", "cleanup", *args],
        check=False,
        capture_output=True,
        text=True,
    )


@pytest.fixture
def other_namespace(namespace):
    """Another deployment's namespace on this host; whatever the test leaves there is
    removed afterwards."""
    other = f"{namespace}o"
    yield other
    _cleanup("--namespace", other)


def test_cleanup_removes_dead_segments_of_the_namespace_named_only(namespace, other_namespace):
    ours, theirs = _dead_segment(namespace), _dead_segment(other_namespace)
    live = ops.open_shm_and_get_meta_signal(0, 0)
    proc = _cleanup("--namespace", namespace)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {ours}" in proc.stdout and theirs not in proc.stdout, proc.stdout
    assert not os.path.exists(ours) and os.path.exists(theirs)
    assert os.path.exists(_names.channel_path("query", 0, 0)) and live.step == 1


def test_a_dry_run_lists_the_dead_and_removes_nothing(namespace, other_namespace):
    ours, theirs = _dead_segment(namespace), _dead_segment(other_namespace)
    ops.open_shm_and_get_meta_signal(0, 0)  # alive: neither listed nor removed
    proc = _cleanup("--dry-run", "--namespace", namespace)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"would remove {ours}",
        "1 dead segment(s) to remove, 1 live segment(s) left alone",
    ]
    assert os.path.exists(ours) and os.path.exists(theirs)
    assert _cleanup("--namespace", namespace).returncode == 0
    assert not os.path.exists(ours)


def test_a_mistyped_option_runs_nothing(namespace):
    ours = _dead_segment(namespace)
    proc = _cleanup("--dry_run", "--namespace", namespace)
    assert proc.returncode == 2 and "unrecognized arguments: --dry_run" in proc.stderr, proc
    assert os.path.exists(ours), "a mistyped --dry-run removed the segment"
    assert _cleanup("--namespace", namespace).returncode == 0
