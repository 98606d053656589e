"""pluggy hook specifications: everything pdhal discovers in other distributions.

A distribution names a module in an entry-point group; the module implements that group's
hook (marked with `hookimpl`). One PluginManager holds them all (plugins.py), and pluggy
checks each hookimpl against these specs when its plugin registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pluggy

hookspec = pluggy.HookspecMarker("pdhal")
hookimpl = pluggy.HookimplMarker("pdhal")


@dataclass(frozen=True)
class Command:
    """A `pdhal` subcommand from another distribution (what pdhal_command returns)."""

    #: One line, for `pdhal --help`.
    help: str
    #: add_arguments(parser): the command's options (cheap: `pdhal --help` runs it).
    add_arguments: Callable
    #: main(args) -> int: runs the command; its exit status.
    main: Callable


class PdhalSpec:
    @hookspec
    def pdhal_backend(self):
        """Return this plugin's Backend instance (cheap: no runtime is loaded yet).
        Entry-point group `pdhal.backends`."""

    @hookspec
    def pdhal_command(self):
        """Return this plugin's Command (`pdhal NAME`, NAME its entry point's name).
        Entry-point group `pdhal.commands`."""

    @hookspec
    def pdhal_transport(self):
        """Return this plugin's Transport instance (pdhal.transfer.Transport; its name is
        the entry point's). Entry-point group `pdhal.transports`."""


#: Entry-point group -> the hook its plugins implement.
GROUP_HOOKS = {
    "pdhal.backends": "pdhal_backend",
    "pdhal.commands": "pdhal_command",
    "pdhal.transports": "pdhal_transport",
}
