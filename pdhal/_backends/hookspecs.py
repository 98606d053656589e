"""pluggy hook specifications of pdhal backend plugins."""

import pluggy

hookspec = pluggy.HookspecMarker("pdhal")
hookimpl = pluggy.HookimplMarker("pdhal")


class BackendSpec:
    @hookspec
    def pdhal_backend(self):
        """Return this plugin's Backend instance (cheap: no runtime is loaded yet)."""
