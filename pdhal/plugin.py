"""What a backend plugin may use from pdhal: the public surface for accelerator vendors.

A backend is its own distribution with an entry point in group `pdhal.backends` naming a
module that implements `pdhal_backend()` (marked with `hookimpl`) and returns a `Backend`
whose `ops()` maps each name of BACKEND_OPS to its implementation. Everything
device-independent (channels, tables, readers) comes from pdhal.

Over a vendor runtime, subclass RuntimeBackend: name the runtime's functions (host
allocator, events, IPC) as class attributes and write only what differs (how a signal
follows a stream without a sender, the peer address, the copy kind).
docs/writing-a-backend.md walks through one. A backend that unmaps memory its own way calls
forget_mapping(address) first: it refuses new ops on the mapping, waits for those using it,
and returns the keys of the streams they queued copies on (RuntimeBackend.wait_queued
waits for those).
"""

from pdhal._backends.contract import BACKEND_OPS, Availability, Backend
from pdhal._backends.hookspecs import Command, hookimpl
from pdhal._backends.platform import Platform
from pdhal._backends.runtime import RuntimeBackend, RuntimeHostBuffer
from pdhal._backends.runtime_library import RuntimeLibrary
from pdhal._inputs.tensors import MemoryRef, is_paddle_tensor, memory_ref
from pdhal._memory.extents import retire as forget_mapping
from pdhal._memory.hostmem import HostBuffer
from pdhal._memory.published import SharedDeviceBuffer
from pdhal._memory.published import publish as publish_shared
from pdhal._memory.published import request as request_shared
from pdhal._memory.published import unset as unset_shared
from pdhal._protocol.core import STORE_CALLBACK_ADDRESS, free_store, store_address
from pdhal._protocol.names import validate_index, validate_name
from pdhal._protocol.sender import KVSignalSender, ProcessSender, require_signal
from pdhal._protocol.signals import LayerSignal


def reference_ops() -> dict:
    """The cpu backend's ops (host memory in shared memory, signals stored at once): a
    starting point a new backend replaces op by op."""
    from pdhal._backends.cpu import backend as _cpu

    return _cpu.CpuBackend().ops()


__all__ = [
    "BACKEND_OPS",
    "Availability",
    "Backend",
    "Command",
    "HostBuffer",
    "KVSignalSender",
    "LayerSignal",
    "MemoryRef",
    "Platform",
    "ProcessSender",
    "RuntimeBackend",
    "RuntimeHostBuffer",
    "RuntimeLibrary",
    "STORE_CALLBACK_ADDRESS",
    "SharedDeviceBuffer",
    "forget_mapping",
    "free_store",
    "hookimpl",
    "is_paddle_tensor",
    "memory_ref",
    "publish_shared",
    "reference_ops",
    "request_shared",
    "require_signal",
    "store_address",
    "unset_shared",
    "validate_index",
    "validate_name",
]
