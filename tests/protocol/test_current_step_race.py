"""Two threads of one producer start per-chunk steps at once: the step published last is
the process's current step (the one a C op's "next layer" posts to). tests/c/current_step_race.c
forces the one interleaving where it matters, built from csrc/ with the call that makes a
step current wrapped (-Wl,--wrap), so no hook is needed in the library."""

from __future__ import annotations

import glob
import os
import subprocess

import pdhal

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(TESTS)


def test_of_two_racing_step_starts_the_later_step_is_current(tmp_path):
    binary = str(tmp_path / "current_step_race")
    subprocess.run(
        [
            "gcc",
            "-std=gnu11",
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{pdhal.get_include()}",
            f"-I{os.path.join(ROOT, 'csrc')}",
            "-o",
            binary,
            os.path.join(TESTS, "c", "current_step_race.c"),
            *sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c"))),
            "-lpthread",
            "-Wl,--wrap=pdhal_chunk_set_current",
        ],
        check=True,
    )
    proc = subprocess.run([binary], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
