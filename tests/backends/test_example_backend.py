"""A backend written from the template that ships in the wheel (`pdhal new-backend NAME`)
takes the path a third party would: its own distribution installed into a temporary
environment, its own entry point, no change to pdhal, and then the conformance kit must
pass against it. The template is a RuntimeBackend over a runtime's C ABI, as pdhal-cuda and
pdhal-xpu are, and binds the simulated runtime it ships (built from its sim/ at first use)."""

from __future__ import annotations

import re
import subprocess
import sys

from pdhal.testing.fixtures import install_distributions


def test_a_new_backend_from_the_template_installs_and_passes_the_kit(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pdhal", "new-backend", "example", "--into", str(tmp_path / "src")],
        check=True,
        capture_output=True,
    )
    env = install_distributions(tmp_path / "site", tmp_path / "src" / "pdhal-example")
    env.pop("PDHAL_NAMESPACE", None)
    info = subprocess.run(
        [sys.executable, "-m", "pdhal", "info"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "selected: example" in info and "pdhal-example 0.1.0" in info
    # (make sanitize builds the simulators with ASan, into build/sanitize)
    simulator = r"library: .*/pdhal_example/sim/build/(sanitize/)?libexample_sim\.so"
    assert re.search(simulator, info), info
    base = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pdhal_example._backend import ExampleBackend\n"
            "from pdhal.plugin import RuntimeBackend\n"
            "print(issubclass(ExampleBackend, RuntimeBackend))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert base.stdout.split() == ["True"]
    kit = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pdhal-backend",
            "example",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert kit.returncode == 0, kit.stdout[-3000:] + kit.stderr[-3000:]
    assert re.search(r"^\d+ passed in", kit.stdout, re.M), kit.stdout[-500:]


def test_new_backend_refuses_bad_names_and_existing_folders(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "pdhal", "new-backend", "My-Accel", "--into", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and bad.stderr.startswith("pdhal: error: a backend name is")
    (tmp_path / "pdhal-acc").mkdir()
    again = subprocess.run(
        [sys.executable, "-m", "pdhal", "new-backend", "acc", "--into", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "exists already" in again.stderr
