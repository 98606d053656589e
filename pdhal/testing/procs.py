"""Child processes for the conformance suite: same environment, `ops` and `support` bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD_PRELUDE = """
from pdhal import ops
from pdhal._backends import registry as _registry
support = _registry.selection().candidate.backend.test_support()
"""


def child(code: str, hold: bool = False, **kwargs) -> subprocess.Popen:
    """A Python child with this environment, `ops` and `support` already bound.

    With `hold`, the child stays alive after `code` until finish(): a producer whose last
    signals are still queued on a device stream must not exit (and unlink its channel)
    before the reader has them.
    """
    if hold:
        code = textwrap.dedent(code) + "\nimport sys\nsys.stdin.read()\n"
        kwargs["stdin"] = subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)],
        env=dict(os.environ),
        **kwargs,
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Release a held child, then require it to exit 0 within `timeout` s."""
    if proc.stdin is not None:
        proc.stdin.close()
    assert proc.wait(timeout=timeout) == 0, f"child exited {proc.returncode}"
