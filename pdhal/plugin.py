"""What a backend plugin may use from pdhal: the public surface for accelerator vendors.

A backend is its own distribution with an entry point in group `pdhal.backends` naming a
module that implements `pdhal_backend()` (marked with `hookimpl`) and returns a `Backend`
whose `ops()` maps each name of BACKEND_OPS to its implementation. Everything
device-independent (channels, tables, readers) comes from pdhal.

Over a vendor runtime, subclass RuntimeBackend: name the runtime's functions (host
allocator, events) as class attributes and write only what differs (how a signal follows a
stream, the peer address, IPC). docs/writing-a-backend.md walks through one.
"""

from pdhal._backend import BACKEND_OPS, Availability, Backend
from pdhal._core import STORE_CALLBACK_ADDRESS, free_store, store_address
from pdhal._extents import retire as forget_mapping
from pdhal._hookspecs import hookimpl
from pdhal._hostmem import HostBuffer
from pdhal._names import validate_index, validate_name
from pdhal._platform import Platform
from pdhal._published import SharedDeviceBuffer
from pdhal._published import publish as publish_shared
from pdhal._published import request as request_shared
from pdhal._published import unset as unset_shared
from pdhal._runtime_backend import RuntimeBackend, RuntimeHostBuffer
from pdhal._runtime_library import RuntimeLibrary
from pdhal._sender import KVSignalSender, ProcessSender, require_signal
from pdhal._signals import LayerSignal
from pdhal._tensors import MemoryRef, is_paddle_tensor, memory_ref


def reference_ops() -> dict:
    """The cpu backend's ops (host memory in shared memory, signals stored at once): a
    starting point a new backend replaces op by op."""
    from pdhal import _cpu

    return _cpu.CpuBackend().ops()


__all__ = [
    "BACKEND_OPS",
    "Availability",
    "Backend",
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
