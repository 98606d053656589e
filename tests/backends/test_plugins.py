"""One PluginManager for everything pdhal discovers (pdhal/_backends/plugins.py): each
plugin is validated against the hookspecs when it registers, and an error names the plugin,
its group and the hook."""

from __future__ import annotations

import types

import pytest

import pdhal.plugin
from pdhal._backends import plugins
from pdhal._backends.hookspecs import hookimpl


def _module(**functions) -> types.ModuleType:
    module = types.ModuleType("pdhal_test_plugin")
    for name, function in functions.items():
        setattr(module, name, hookimpl(function))
    return module


@pytest.fixture(autouse=True)
def fresh_manager():
    plugins.forget()
    yield
    plugins.forget()


def test_backends_and_commands_share_one_manager_and_each_gets_its_group_hook():
    backend = object()
    command = pdhal.plugin.Command("help", lambda parser: None, lambda args: 0)
    assert plugins.provide("pdhal.backends", "b", lambda: _module(pdhal_backend=lambda: backend))
    assert plugins.provide("pdhal.commands", "c", lambda: _module(pdhal_command=lambda: command))
    assert plugins.manager().get_plugin("pdhal.backends:b") is not None
    assert plugins.manager().get_plugin("pdhal.commands:c") is not None


def test_one_module_may_serve_a_backend_and_a_command():
    module = _module(pdhal_backend=lambda: "backend", pdhal_command=lambda: "command")
    assert plugins.provide("pdhal.backends", "both", lambda: module) == "backend"
    assert plugins.provide("pdhal.commands", "both", lambda: module) == "command"
    assert plugins.provide("pdhal.backends", "both", lambda: module) == "backend"


def test_a_misspelt_hook_is_refused_with_the_plugin_and_the_hook():
    with pytest.raises(
        TypeError, match=r"plugin 'typo' \(pdhal.backends\) implements pdhal_backnd"
    ):
        plugins.provide("pdhal.backends", "typo", lambda: _module(pdhal_backnd=lambda: None))
    assert plugins.manager().get_plugin("pdhal.backends:typo") is None


def test_a_hookimpl_taking_arguments_its_spec_does_not_have_is_refused():
    with pytest.raises(TypeError, match=r"plugin 'args' \(pdhal.backends\).*pdhal_backend"):
        plugins.provide("pdhal.backends", "args", lambda: _module(pdhal_backend=lambda config: 1))


def test_a_plugin_without_its_group_s_hook_is_refused():
    with pytest.raises(
        TypeError, match=r"'cmd' \(pdhal.commands\) does not implement pdhal_command"
    ):
        plugins.provide("pdhal.commands", "cmd", lambda: _module(pdhal_backend=lambda: 1))
