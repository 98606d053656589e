"""Entry point module: cheap to import (Mooncake's engine, which loads libibverbs, is
imported when the transport is first used)."""

import importlib.util

from pdhal import hookimpl


@hookimpl
def pdhal_transport():
    if importlib.util.find_spec("mooncake") is None:
        raise ImportError(
            "Mooncake's transfer engine is not installed: pip install 'pdhal-mooncake[non-cuda]' "
            "(or 'pdhal-mooncake[cuda]')"
        )
    from pdhal_mooncake._transport import MooncakeTransport

    return MooncakeTransport()
