"""The pytest plugin: `--pdhal-backend NAME` selects the backend and runs the backend kit's
suite; `--pdhal-transport NAME` runs the transport kit's suite against transport NAME; the
ini option `pdhal_isolate = true` gives every test a PDHAL_NAMESPACE of its own and fails
one that leaves a segment behind (pdhal.testing.fixtures.namespace, autouse)."""

from __future__ import annotations

import os

import pytest

SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite")
TRANSPORT_SUITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transport_suite")


def pytest_addoption(parser):
    group = parser.getgroup("pdhal")
    group.addoption(
        "--pdhal-backend",
        metavar="NAME",
        default=None,
        help="run pdhal's backend conformance suite against backend NAME",
    )
    group.addoption(
        "--pdhal-transport",
        metavar="NAME",
        default=None,
        help="run pdhal's transport conformance suite against transport NAME",
    )
    parser.addini(
        "pdhal_isolate",
        type="bool",
        default=False,
        help="every test in a PDHAL_NAMESPACE of its own, failed if it leaves a segment behind",
    )


def pytest_configure(config):
    if config.getini("pdhal_isolate"):
        config.pluginmanager.import_plugin("pdhal.testing.fixtures")
    name = config.getoption("pdhal_backend", default=None)
    if name:
        os.environ["PDHAL_PLATFORM"] = name  # child processes of the suite inherit it
        _require_usable(name)
        config.args[:] = [SUITE]
    transport = config.getoption("pdhal_transport", default=None)
    if transport:
        os.environ["PDHAL_KIT_TRANSPORT"] = transport  # the suite's child processes too
        _require_transport(transport)
        config.args[:] = [TRANSPORT_SUITE]


def _require_transport(name: str) -> None:
    """Stop the run once, with one line, when the transport cannot be loaded."""
    from pdhal import PdhalError
    from pdhal.transfer import transport

    try:
        transport(name)
    except PdhalError as e:
        raise pytest.UsageError(f"pdhal transport kit: --pdhal-transport {name}: {e}") from None


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
