"""Child processes for the conformance suite: same environment, `ops` and `support` bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD_PRELUDE = """
from pdhal import _registry, ops
support = _registry.selection().candidate.backend.test_support()
"""


def child(code: str, **kwargs) -> subprocess.Popen:
    """A Python child with this environment, `ops` and `support` already bound."""
    return subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)],
                            env=dict(os.environ), **kwargs)


def finish(proc: subprocess.Popen, timeout: float = 60) -> None:
    assert proc.wait(timeout=timeout) == 0, f"child exited {proc.returncode}"
