"""The examples in docs/api.md run as written (its promise), each in a fresh process on the
cpu backend, and leave no segment behind."""

from __future__ import annotations

import os
import re

import pytest
from conftest import run_child

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs")


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
