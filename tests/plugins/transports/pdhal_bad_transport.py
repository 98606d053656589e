"""Test-only: a transport plugin whose hook returns no Transport."""

from pdhal import hookimpl


@hookimpl
def pdhal_transport():
    return "not a transport"
