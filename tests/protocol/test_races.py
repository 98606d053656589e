"""Lost wake-ups, forced: tests/c/race_test.c built from csrc/ with the test-only hooks that
widen the race window between a writer's sequence bump and its look for sleeping readers
(compiled out of the library itself). `make tsan` runs the memory-ordering checks of the
same program under ThreadSanitizer."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

import pdhal

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(TESTS)


@pytest.fixture(scope="module")
def race_test(tmp_path_factory) -> str:
    binary = str(tmp_path_factory.mktemp("race") / "race_test")
    subprocess.run(
        [
            "gcc",
            "-std=gnu11",
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-DPDHAL_TEST_HOOKS",
            f"-I{pdhal.get_include()}",
            f"-I{os.path.join(ROOT, 'csrc')}",
            "-o",
            binary,
            os.path.join(TESTS, "c", "race_test.c"),
            *sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c"))),
            "-lpthread",
        ],
        check=True,
    )
    return binary


@pytest.mark.parametrize(
    "check", ["lost_wake", "query_payload", "ring_payload", "ring_lapped", "step_race"]
)
def test_race_checks_hold(race_test, check):
    """lost_wake makes the reader register while the writer sits between its two steps:
    with the steps in the wrong order (look for waiters, then bump), the reader sleeps
    through the publish until its 200 ms slice ends, every run."""
    proc = subprocess.run([race_test, check], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
