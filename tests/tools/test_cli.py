"""The `pdhal` command's plugin point: commands added by other distributions (`pdhal.commands`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pdhal._tools import cli as _cli
from pdhal.testing.fixtures import install_distributions

HELLO = '''
    """A command from a distribution of its own."""
    import os

    from pdhal.plugin import Command, hookimpl

    if os.environ.get("IMPORT_LOG"):
        with open(os.environ["IMPORT_LOG"], "a") as log:
            log.write("hello\\n")


    def add_arguments(parser):
        parser.add_argument("--name", default="world")


    def main(args):
        print(f"hello {args.name}")
        return 3


    @hookimpl
    def pdhal_command():
        return Command("Greets: a command from a distribution of its own.", add_arguments, main)
'''


@pytest.fixture(scope="module")
def command_env(tmp_path_factory):
    """A --target folder on PYTHONPATH holding one distribution with three commands: `hello`
    (works), `kaput` (its module fails to import) and `info` (clashes with a built-in)."""
    source = tmp_path_factory.mktemp("source")
    (source / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "pdhal-hello-command"
        version = "0.0.1"

        [project.entry-points."pdhal.commands"]
        hello = "pdhal_hello_command"
        kaput = "pdhal_kaput_command"
        info = "pdhal_hello_command"

        [tool.setuptools]
        py-modules = ["pdhal_hello_command", "pdhal_kaput_command"]
    """)
    )
    (source / "pdhal_hello_command.py").write_text(textwrap.dedent(HELLO))
    (source / "pdhal_kaput_command.py").write_text(
        "raise ImportError('libkaput.so.1 is missing')\n"
    )
    target = tmp_path_factory.mktemp("commands")
    env = install_distributions(target, source)
    env["IMPORT_LOG"] = str(target / "imported.log")
    return env


def pdhal(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdhal", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_command_from_another_distribution_runs(command_env):
    run = pdhal(command_env, "hello", "--name", "pdhal")
    assert (run.returncode, run.stdout) == (3, "hello pdhal\n"), run.stderr
    assert "kaput" not in run.stderr  # only the command that runs is loaded


def test_help_lists_it_and_reports_the_broken_and_the_clashing_one(command_env):
    run = pdhal(command_env, "--help")
    assert run.returncode == 0, run.stderr
    assert "Greets: a command from a distribution of its own." in run.stdout
    assert (
        "command 'kaput' (pdhal_kaput_command, from pdhal-hello-command 0.0.1) failed to "
        "load and is skipped: ImportError: libkaput.so.1 is missing"
    ) in run.stderr
    assert (
        "command 'info' (pdhal_hello_command, from pdhal-hello-command 0.0.1) is skipped: "
        "it is built in" in run.stderr
    )


def test_builtin_commands_import_no_command_module(command_env, tmp_path):
    env = dict(command_env, IMPORT_LOG=str(tmp_path / "imported.log"), PDHAL_PLATFORM="cpu")
    run = pdhal(env, "info", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["selected"] == "cpu"
    assert run.stderr == ""
    assert not os.path.exists(tmp_path / "imported.log")
    assert pdhal(env, "hello").returncode == 3
    assert (tmp_path / "imported.log").read_text() == "hello\n"


def test_a_broken_command_that_is_asked_for_exits_2(command_env):
    run = pdhal(command_env, "kaput")
    assert run.returncode == 2
    assert "command 'kaput'" in run.stderr and "libkaput.so.1 is missing" in run.stderr


def test_demo_not_installed_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(_cli, "_command_entry_points", lambda: {})
    assert _cli.main(["demo", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e demo" in err and "pdhal-demo" in err
