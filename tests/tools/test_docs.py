"""The examples in docs/api.md run as written (its promise), each in a fresh process on the
cpu backend, and leave no segment behind."""

from __future__ import annotations

import os
import re

import pytest

from pdhal.testing.fixtures import run_child

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs")


def _examples(name: str) -> list[tuple[int, str]]:
    with open(os.path.join(DOCS, name)) as f:
        text = f.read()
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(1))
        for m in re.finditer(r"```python\n(.*?)```", text, re.S)
    ]


API_EXAMPLES = _examples("api.md")


def test_the_reference_has_examples():
    assert len(API_EXAMPLES) >= 10


def _as_params(examples: list[tuple[int, str]]) -> list:
    """One parameter per example, marked `paddle` when it imports paddle (so the sanitizer
    run, which cannot load paddle, leaves it out)."""
    return [
        pytest.param(
            line,
            code,
            id=f"api.md:{line}",
            marks=[pytest.mark.paddle] if re.search(r"^import paddle", code, re.M) else [],
        )
        for line, code in examples
    ]


@pytest.mark.parametrize("line, code", _as_params(API_EXAMPLES))
def test_api_examples_run_as_written(line, code):
    run_child(code, env=dict(os.environ, PDHAL_PLATFORM="cpu"))


#: Every name fastdeploy/cache_manager/ops.py exports, in its 2025 versions (their __all__).
FASTDEPLOY_CACHE_MANAGER_OPS = [
    "cuda_host_alloc",
    "cuda_host_free",
    "get_all_visible_devices",
    "get_data_ptr_ipc",
    "get_output_kv_signal",
    "get_peer_mem_addr",
    "ipc_sent_key_value_cache_by_remote_ptr",
    "ipc_sent_key_value_cache_by_remote_ptr_block_sync",
    "memory_allocated",
    "set_data_ipc",
    "set_device",
    "share_external_data_",
    "swap_cache_all_layers",
    "swap_cache_layout",
    "swap_cache_per_layer",
    "swap_cache_per_layer_async",
    "unset_data_ipc",
]


def test_the_fastdeploy_guide_s_import_line_replaces_cache_manager_ops():
    """docs/engines/fastdeploy.md says one import line replaces cache_manager/ops.py: it runs,
    and binds a function for every name that file exports."""
    (code,) = [
        code
        for _, code in _examples(os.path.join("engines", "fastdeploy.md"))
        if "swap_cache_all_layers" in code and "from pdhal.compat.fastdeploy import" in code
    ]
    check = (
        f"\nnames = {FASTDEPLOY_CACHE_MANAGER_OPS!r}"
        "\nmissing = [n for n in names if not callable(globals().get(n))]"
        "\nassert not missing, missing\n"
    )
    run_child(code + check, env=dict(os.environ, PDHAL_PLATFORM="cpu"))
