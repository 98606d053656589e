"""The pytest plugin: `--pdhal-backend NAME` selects the backend and runs the kit's suite."""

from __future__ import annotations

import os

import pytest

SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite")


def pytest_addoption(parser):
    group = parser.getgroup("pdhal")
    group.addoption(
        "--pdhal-backend",
        metavar="NAME",
        default=None,
        help="run pdhal's backend conformance suite against backend NAME",
    )


def pytest_configure(config):
    name = config.getoption("pdhal_backend", default=None)
    if name:
        os.environ["PDHAL_PLATFORM"] = name  # child processes of the suite inherit it
        _require_usable(name)
        config.args[:] = [SUITE]


def _require_usable(name: str) -> None:
    """Stop the run once, with one line, when the backend cannot be selected: every test
    would fail the same way."""
    from pdhal import PdhalError
    from pdhal._backends import registry as _registry

    _registry.reset()
    try:
        _registry.selection()
    except PdhalError as e:
        message = str(e).replace("(PDHAL_PLATFORM)", "(--pdhal-backend)")
        raise pytest.UsageError(
            f"pdhal conformance kit: --pdhal-backend {name}: {message}"
        ) from None


@pytest.fixture(scope="session")
def pdhal_backend_name(request) -> str:
    name = request.config.getoption("pdhal_backend")
    if not name:
        pytest.fail("the conformance suite runs through `pytest --pdhal-backend NAME`")
    return name
