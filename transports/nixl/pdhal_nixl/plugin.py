"""Entry point module: cheap to import (NIXL, which loads UCX and its plugins, is imported
when the transport is first used)."""

import importlib.util

from pdhal import hookimpl


@hookimpl
def pdhal_transport():
    if importlib.util.find_spec("nixl") is None:
        raise ImportError(
            "NIXL is not installed: pip install 'pdhal-nixl[nixl]' (or one build: "
            "'pdhal-nixl[cu12]', 'pdhal-nixl[cu13]')"
        )
    from pdhal_nixl._transport import NixlTransport

    return NixlTransport()
