"""docs/quickstart.md's engine, run as a user would run it: its code block, as a file, in
two real processes (it starts its decode side itself)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def test_the_quickstart_runs_and_both_sides_see_the_request_land(tmp_path):
    with open(os.path.join(DOC, "quickstart.md")) as f:
        [code] = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(line.split(":")[0] for line in lines) == ["decode", "prefill"], done
    assert all("request_id='req-1', landed=True" in line for line in lines), lines
