"""The op table (pdhal/_backends/optable.py) is the one declaration of pdhal.ops: what the
registry binds, what a backend must implement and what the ops' docs list all come from it."""

from __future__ import annotations

import re

import pytest

import pdhal
from pdhal import ops
from pdhal._backends import optable, registry


def test_every_op_is_declared_once_and_each_pdhal_op_names_a_real_function():
    assert len(set(optable.OP_NAMES)) == len(optable.OPS)
    for op in optable.OPS:
        assert op.by in ("backend", "pdhal"), op
        if op.alias_of:
            assert op.alias_of in optable.BACKEND_OPS, op
        elif op.by == "pdhal":
            assert callable(optable._function(op.impl)), op
            assert not op.built_from or op.built_from in optable.BACKEND_OPS, op


def test_the_bound_table_is_the_op_table():
    table = registry.selection().ops
    assert sorted(table) == sorted(ops.OP_NAMES) == sorted(optable.OP_NAMES)
    assert ops.cuda_host_alloc is ops.host_alloc and ops.cuda_host_free is ops.host_free
    from pdhal.plugin import BACKEND_OPS

    assert BACKEND_OPS == optable.BACKEND_OPS


def test_the_ops_docstring_lists_every_op_from_the_table():
    listed = re.findall(r"\w+", ops.__doc__.split("by what they are for:", 1)[1])
    assert set(optable.OP_NAMES) <= set(listed)


def test_a_backend_missing_a_table_op_is_refused_by_name(monkeypatch):
    from pdhal._backends.cpu import backend as cpu

    real = cpu.CpuBackend.ops
    monkeypatch.setattr(
        cpu.CpuBackend,
        "ops",
        lambda self: {k: v for k, v in real(self).items() if k != "host_free"},
    )
    registry.reset()
    with pytest.raises(pdhal.BackendLoadError, match="does not implement host_free"):
        ops.host_alloc  # noqa: B018 - binding the table is what is tested
