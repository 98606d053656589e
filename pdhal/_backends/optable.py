"""The op table: every name of pdhal.ops, declared once. From it come pdhal.ops' names
(OP_NAMES), the ops a backend must implement (BACKEND_OPS, which the registry checks and the
conformance kit proves), the ops pdhal implements itself, and the op list of pdhal.ops' docs.

An op is implemented by each backend ("backend"), by pdhal the same way on every device
("pdhal": `impl` names the function), built by pdhal from a backend op (`impl` names a
factory given that op), or is another op under a second name (`alias_of`).
"""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str
    #: What the op is for, as pdhal.ops' docstring groups them.
    group: str
    #: "backend": each backend implements it; "pdhal": implemented once, at `impl`.
    by: str
    #: "module:function" of pdhal's implementation (or of the factory, with `built_from`).
    impl: str = ""
    #: The backend op a factory at `impl` builds this op from.
    built_from: str = ""
    #: This op is the op named here, under a second name (FastDeploy's).
    alias_of: str = ""


_SIGNALS = "pdhal._protocol.signals"
OPS = (
    Op(
        "open_shm_and_get_meta_signal",
        "producer",
        "pdhal",
        f"{_SIGNALS}:open_shm_and_get_meta_signal",
    ),
    Op("init_signal_layerwise", "producer", "pdhal", f"{_SIGNALS}:init_signal_layerwise"),
    Op("init_kv_signal_per_query", "producer", "pdhal", f"{_SIGNALS}:init_kv_signal_per_query"),
    Op("signal_layer_ready", "producer", "backend"),
    Op("create_kv_signal_sender", "producer", "backend"),
    Op(
        "destroy_kv_signal_sender",
        "producer",
        "pdhal",
        "pdhal._protocol.sender:destroy_kv_signal_sender",
    ),
    Op("open_kv_signal_reader", "consumer", "pdhal", f"{_SIGNALS}:open_kv_signal_reader"),
    Op("open_kv_chunk_reader", "consumer", "pdhal", f"{_SIGNALS}:open_kv_chunk_reader"),
    Op("get_output_kv_signal", "consumer", "pdhal", f"{_SIGNALS}:get_output_kv_signal"),
    Op("ack_kv_signal", "consumer", "pdhal", f"{_SIGNALS}:ack_kv_signal"),
    Op("host_alloc", "memory", "backend"),
    Op("host_free", "memory", "backend"),
    Op("cuda_host_alloc", "memory", "pdhal", alias_of="host_alloc"),
    Op("cuda_host_free", "memory", "pdhal", alias_of="host_free"),
    Op("host_register", "memory", "backend"),
    Op("host_unregister", "memory", "backend"),
    Op("get_peer_mem_addr", "memory", "backend"),
    Op("set_data_ipc", "memory", "backend"),
    Op("share_external_data", "memory", "backend"),
    Op(
        "get_data_ptr_ipc",
        "memory",
        "pdhal",
        "pdhal._memory.published:data_ptr_op",
        "share_external_data",
    ),
    Op("unset_data_ipc", "memory", "backend"),
    Op("copy_blocks", "copies", "backend"),
    Op("synchronize", "copies", "backend"),
)

#: Every op of pdhal.ops, in the table's order.
OP_NAMES = tuple(op.name for op in OPS)
#: The ops a backend implements: the device-specific part of pdhal.ops.
BACKEND_OPS = tuple(op.name for op in OPS if op.by == "backend")


def _function(path: str) -> Callable:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def bind(backend_ops: dict[str, Callable]) -> dict[str, Callable]:
    """The whole table bound: each op's function, given a backend's checked ops."""
    table = dict(backend_ops)
    for op in OPS:
        if op.by == "pdhal" and not op.alias_of:
            impl = _function(op.impl)
            table[op.name] = impl(backend_ops[op.built_from]) if op.built_from else impl
    for op in OPS:
        if op.alias_of:
            table[op.name] = table[op.alias_of]
    return table


def describe() -> str:
    """The op list by group, for pdhal.ops' docstring."""
    groups: dict[str, list[str]] = {}
    for op in OPS:
        name = f"{op.name} (= {op.alias_of})" if op.alias_of else op.name
        groups.setdefault(op.group, []).append(name)
    return "\n".join(
        textwrap.fill(f"{group.title()}: {', '.join(names)}.", 92)
        for group, names in groups.items()
    )
