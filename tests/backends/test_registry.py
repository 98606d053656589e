"""Backend discovery and selection with plugins installed as separate distributions."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.testing.fixtures import install_distributions

PLUGINS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins")


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """A temporary environment (a --target folder on PYTHONPATH) holding the dummy and the
    broken plugin, each installed by pip as its own distribution."""
    target = tmp_path_factory.mktemp("plugins")
    plugins = [os.path.join(PLUGINS, name) for name in ("dummy", "broken")]
    return install_distributions(target, *plugins)


def _info(env, *extra_env) -> tuple[int, dict | str]:
    env = dict(env)
    for item in extra_env:
        key, value = item.split("=", 1)
        env[key] = value
    proc = subprocess.run(
        [sys.executable, "-m", "pdhal", "info", "--json"], env=env, capture_output=True, text=True
    )
    return proc.returncode, json.loads(proc.stdout)


def test_separate_distribution_is_discovered_and_selected(plugin_env):
    code, info = _info(plugin_env)
    assert code == 0
    assert info["selected"] == "dummy"
    by_name = {b["name"]: b for b in info["backends"]}
    assert by_name["dummy"]["distribution"] == "pdhal-dummy-backend"
    assert by_name["dummy"]["version"] == "1.2.3"
    assert by_name["cpu"]["status"] == "available"


def test_broken_plugin_is_reported_and_isolated(plugin_env):
    code, info = _info(plugin_env, "PDHAL_PLUGINS=broken")
    assert code == 0 and info["selected"] == "cpu"
    broken = {b["name"]: b for b in info["backends"]}["broken"]
    assert broken["status"] == "broken"
    assert "libvendor.so.9" in broken["error"]


def test_forced_platform_names_distribution_and_cause(plugin_env):
    env = dict(plugin_env, PDHAL_PLATFORM="broken")
    proc = subprocess.run(
        [sys.executable, "-c", "from pdhal import ops; ops.host_alloc"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "BackendLoadError" in proc.stderr
    assert "pdhal-broken-backend 0.0.1" in proc.stderr and "libvendor.so.9" in proc.stderr


def test_forced_platform_imports_only_that_plugin(plugin_env):
    code = (
        "import sys; from pdhal import ops; ops.host_alloc; "
        "print('pdhal_dummy_backend' in sys.modules, 'pdhal_broken_backend' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(plugin_env, PDHAL_PLATFORM="cpu"),
    )
    assert proc.stdout.split() == ["False", "False"], proc.stderr


def test_unknown_platform_lists_what_is_installed(monkeypatch):
    monkeypatch.setenv("PDHAL_PLATFORM", "xpuu")
    with pytest.raises(
        pdhal.BackendNotFoundError, match=r"no backend 'xpuu' \(PDHAL_PLATFORM\); installed: cpu"
    ):
        _ = ops.signal_layer_ready


def test_selection_happens_once_and_binds_plain_attributes():
    first = ops.signal_layer_ready
    assert "signal_layer_ready" in vars(ops)  # later lookups never reach __getattr__
    assert _registry.selection() is _registry.selection()
    assert ops.signal_layer_ready is first
    assert pdhal.current_backend() == "cpu"


def test_unknown_op_is_an_attribute_error_listing_ops():
    with pytest.raises(AttributeError, match="no op 'signal_layer'"):
        _ = ops.signal_layer


def test_import_is_light():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import pdhal"],
        capture_output=True,
        text=True,
        check=True,
    )
    modules = {
        line.split("|")[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "pdhal" in modules
    heavy = {
        m
        for m in modules
        if m.split(".")[0] in ("paddle", "numpy", "torch", "cupy")
        or ("cuda" in m or "xpu" in m)
        and not m.startswith("__editable__")
    }
    assert not heavy, heavy


def test_a_backend_missing_ops_is_told_exactly_which():
    from pdhal._backends.contract import check_ops
    from pdhal.plugin import reference_ops

    table = reference_ops()
    del table["host_free"], table["set_data_ipc"]
    table["host_fre"] = print
    table["get_peer_mem_addr"] = 42
    with pytest.raises(pdhal.BackendLoadError) as info:
        check_ops(table, "backend 'x'")
    message = str(info.value)
    assert "backend 'x' does not implement host_free, set_data_ipc" in message
    assert "gives non-callables for get_peer_mem_addr" in message
    assert "offers ops pdhal does not know: host_fre" in message
    with pytest.raises(pdhal.BackendLoadError, match="returned list, expected a dict"):
        check_ops([], "backend 'x'")


def test_every_public_name_resolves_and_the_classes_ops_return_are_exported():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            """
import sys, pdhal
assert "pdhal._protocol.core" not in sys.modules  # nothing compiled is loaded by the import
missing = [name for name in pdhal.__all__ if getattr(pdhal, name, None) is None]
assert not missing, missing
assert set(pdhal.__all__) <= set(dir(pdhal))
from pdhal import ops
assert isinstance(ops.open_shm_and_get_meta_signal(0, 0), pdhal.SignalMeta)
print("ok")
""",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout == "ok\n", proc.stderr


def test_errors_read_as_their_message_and_keep_their_errno():
    ops.open_shm_and_get_meta_signal(0, 0)
    with ops.open_kv_signal_reader(0, 0) as reader:
        with pytest.raises(pdhal.SignalTimeoutError) as caught:
            reader.wait(reader.current(), timeout=0)
    assert caught.value.errno == errno.ETIMEDOUT
    assert not str(caught.value).startswith("[Errno"), str(caught.value)
