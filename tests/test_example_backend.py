"""The template backend under examples/ takes the path a third party would: its own
distribution installed into a temporary environment, its own entry point, no change to
pdhal, and then the conformance kit must pass against it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_template_backend_installs_and_passes_the_kit(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(tmp_path),
                    os.path.join(ROOT, "examples", "pdhal-example-backend")], check=True)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("PDHAL_NAMESPACE", None)
    info = subprocess.run([sys.executable, "-m", "pdhal", "info"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert "selected: example" in info and "pdhal-example-backend 0.1.0" in info
    kit = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--pdhal-backend", "example"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-3000:]
    assert re.search(r"^\d+ passed in", kit.stdout, re.M), kit.stdout[-500:]
