"""What a backend plugin may use from pdhal: the public surface for accelerator vendors.

A backend is its own distribution with an entry point in group `pdhal.backends` naming a
module that implements `pdhal_backend()` (marked with `hookimpl`) and returns a `Backend`.
Everything device-independent (channels, tables, readers) comes from pdhal; a backend
provides the ops in BACKEND_OPS, using these pieces.
"""

from pdhal._backend import BACKEND_OPS, Availability, Backend
from pdhal._core import STORE_CALLBACK_ADDRESS, free_store, store_address
from pdhal._hookspecs import hookimpl
from pdhal._hostmem import HostBuffer
from pdhal._names import validate_index, validate_name
from pdhal._platform import Platform
from pdhal._published import SharedDeviceBuffer, publish as publish_shared
from pdhal._published import request as request_shared
from pdhal._runtime_library import RuntimeLibrary
from pdhal._sender import (
    KVSignalSender,
    ProcessSender,
    destroy_kv_signal_sender,
    require_signal,
)
from pdhal._signals import LayerSignal
from pdhal._tensors import MemoryRef, is_paddle_tensor, memory_ref



def reference_memory_ops() -> dict:
    """The cpu backend's memory ops (host_alloc, host_free, get_peer_mem_addr, set_data_ipc,
    share_external_data): a starting point a new backend replaces op by op."""
    from pdhal import _cpu

    return {name: fn for name, fn in _cpu.CpuBackend().ops().items()
            if name in ("host_alloc", "host_free", "get_peer_mem_addr", "set_data_ipc",
                        "share_external_data")}


__all__ = [
    "BACKEND_OPS", "Availability", "Backend", "HostBuffer", "KVSignalSender", "LayerSignal",
    "MemoryRef", "Platform", "ProcessSender", "RuntimeLibrary", "STORE_CALLBACK_ADDRESS",
    "SharedDeviceBuffer", "destroy_kv_signal_sender", "free_store", "hookimpl",
    "is_paddle_tensor", "memory_ref", "publish_shared", "reference_memory_ops", "request_shared", "require_signal",
    "store_address", "validate_index", "validate_name",
]
