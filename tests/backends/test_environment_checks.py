"""The PDHAL_* variables are checked before anything starts (pdhal.check_environment(), and
`pdhal info`, which shows each bad value with what is wrong): the checks refuse what cannot
work and pass what can."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pdhal


@pytest.mark.parametrize("value", ["60", "0.5", "1e-3"])
def test_a_positive_backpressure_timeout_passes(monkeypatch, value):
    monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", value)
    pdhal.check_environment()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "abc", ""])
def test_a_backpressure_timeout_that_cannot_work_is_refused(monkeypatch, value):
    monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", value)
    with pytest.raises(
        pdhal.InvalidArgumentError,
        match="PDHAL_BACKPRESSURE_TIMEOUT: must be a positive number of seconds",
    ):
        pdhal.check_environment()


def test_a_segments_folder_anyone_may_write_passes_only_with_the_sticky_bit(monkeypatch, tmp_path):
    """/dev/shm and /tmp are world-writable with the sticky bit: fine. Without it any user
    could replace pdhal's segments there."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    monkeypatch.setenv("PDHAL_SHM_DIR", str(folder))
    pdhal.check_environment()
    folder.chmod(0o777)
    with pytest.raises(pdhal.InvalidArgumentError, match="PDHAL_SHM_DIR: .*no sticky bit"):
        pdhal.check_environment()
    folder.chmod(0o700)
    pdhal.check_environment()


def test_pdhal_info_reports_each_bad_variable(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    env = dict(
        os.environ,
        PDHAL_SHM_DIR=str(folder),
        PDHAL_BACKPRESSURE_TIMEOUT="0",
        PDHAL_CPU_DEVICE_COUNT="2",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pdhal", "info", "--json"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    problems = json.loads(proc.stdout)["environment_problems"]
    assert sorted(problems) == ["PDHAL_BACKPRESSURE_TIMEOUT", "PDHAL_SHM_DIR"], problems
