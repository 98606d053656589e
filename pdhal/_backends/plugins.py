"""The one pluggy PluginManager of a process: every plugin pdhal discovers, whatever its
entry-point group (hookspecs.GROUP_HOOKS), registered once as "GROUP:NAME" (a module that
serves two groups keeps its first name).

Registering validates the plugin: pluggy refuses a hookimpl whose arguments its spec does
not have, and pdhal refuses a plugin that implements a hook with no spec (a misspelt name)
or not its group's hook; each error names the plugin, its group and the hook.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pluggy

from pdhal._backends import hookspecs

_manager: pluggy.PluginManager | None = None
_lock = threading.RLock()


def manager() -> pluggy.PluginManager:
    """The process's PluginManager, made on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = pluggy.PluginManager("pdhal")
            _manager.add_hookspecs(hookspecs.PdhalSpec)
        return _manager


def provide(group: str, name: str, load: Callable[[], object]) -> object:
    """What the plugin `name` of entry-point `group` gives through its group's hook; the
    plugin is imported (load()) and registered the first time. Raises TypeError when
    it does not validate (the caller reports it with the plugin's origin); whatever the
    import or the hook raise passes through."""
    hook = hookspecs.GROUP_HOOKS[group]
    with _lock:
        pm = manager()
        plugin = load()  # a module: imported once, then the same object from sys.modules
        registering = not pm.is_registered(plugin)  # one module may serve several groups
        if registering:
            try:
                pm.register(plugin, name=f"{group}:{name}")
            except pluggy.PluginValidationError as e:
                raise TypeError(f"plugin {name!r} ({group}): {e}") from None
        try:
            _validate(pm, plugin, name, group, hook)
        except TypeError:
            if registering:
                pm.unregister(plugin)
            raise
        impl = next(i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin is plugin)
    return impl.function()


def _validate(pm: pluggy.PluginManager, plugin: object, name: str, group: str, hook: str):
    callers = pm.get_hookcallers(plugin) or []
    unknown = sorted(c.name for c in callers if c.spec is None)
    if unknown:
        raise TypeError(
            f"plugin {name!r} ({group}) implements {', '.join(unknown)}, which pdhal has no "
            f"hook for (hooks: {', '.join(hookspecs.GROUP_HOOKS.values())})"
        )
    if hook not in {c.name for c in callers}:
        raise TypeError(
            f"plugin {name!r} ({group}) does not implement {hook} (mark it with pdhal.hookimpl)"
        )


def forget() -> None:
    """Drop every registration (tests; a process normally discovers once)."""
    global _manager
    with _lock:
        _manager = None
