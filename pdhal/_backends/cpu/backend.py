"""The `cpu` reference backend: embedded, always available, real implementations.

Work submitted "to a stream" on the CPU is already done when the call returns, so a layer
signal is stored at once (or, with a sender, as soon as the sender thread reaches it). Host
memory is a pdhal shared-memory segment, locked in RAM when RLIMIT_MEMLOCK allows, which is
also what makes it shareable with set_data_ipc. CpuBackend.ops() names the functions below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

from pdhal._backends.contract import Availability, Backend
from pdhal._backends.hookspecs import hookimpl
from pdhal._backends.platform import Platform
from pdhal._errors import DeviceError, InvalidArgumentError, InvalidTypeError, UnsupportedError
from pdhal._inputs.tensors import memory_ref
from pdhal._memory import blocks as _blocks
from pdhal._memory import extents as _extents
from pdhal._memory import mappings as _mappings
from pdhal._memory import published as _published
from pdhal._memory import sharedhost as _sharedhost
from pdhal._memory.hostmem import HostBuffer
from pdhal._memory.sharedhost import SharedHostBuffer
from pdhal._protocol import names as _names
from pdhal._protocol.sender import KVSignalSender, require_signal


class CpuPlatform(Platform):
    name = "cpu"
    #: Lets tests and demos exercise visibility handling on a machine without accelerators.
    device_control_env_var = "PDHAL_CPU_VISIBLE_DEVICES"

    def device_count(self) -> int:
        """Logical devices: PDHAL_CPU_DEVICE_COUNT (default 1), narrowed by visibility."""
        raw = os.environ.get("PDHAL_CPU_DEVICE_COUNT", "1")
        if not raw.isdigit() or int(raw) < 1:
            raise InvalidArgumentError(f"PDHAL_CPU_DEVICE_COUNT must be an int >= 1, got {raw!r}")
        visible = self.visible_devices()
        return int(raw) if visible is None else len(visible)

    @property
    def capabilities(self) -> dict[str, object]:
        return {
            "host_function": False,
            "async_sender": True,
            "ipc": "shm",
            "pinned_host_memory": _memlock_allowed(),
            "peer_address": "identity",
        }


# ---- pinned host memory --------------------------------------------------------------


def _load_libc() -> ctypes.CDLL:
    """libc itself: glibc's soname first (find_library runs ldconfig: ~10 ms a process);
    never the process's own symbols, where a preloaded sanitizer's stand-in mlock is found
    (ASan's does nothing and succeeds)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not glibc
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


_libc = _load_libc()
_registered_lock = threading.Lock()


def _memlock_allowed() -> bool:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or soft >= (1 << 20)


class CpuHostBuffer(SharedHostBuffer):
    """Host memory in a pdhal shared-memory segment, mlock'ed when the limit allows."""

    def _pin(self, address: int, nbytes: int) -> bool:
        return _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0

    def _unpin(self, queued_on: set) -> None:
        # the cpu backend's copies are done on return: none queued
        if self.pinned:
            _libc.munlock(ctypes.c_void_p(self._address), ctypes.c_size_t(self.nbytes))


def host_alloc(nbytes: int) -> CpuHostBuffer:
    """Allocate `nbytes` of pinned (when permitted), shareable host memory."""
    nbytes = _names.validate_index(nbytes, "nbytes", 1 << 46)
    if nbytes == 0:
        raise InvalidArgumentError("nbytes must be at least 1")
    # Locking pages means touching them all: a request beyond RAM would grind, not fail.
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > ram:
        raise InvalidArgumentError(
            f"nbytes {nbytes} is more than this machine's memory ({ram} bytes)"
        )
    return CpuHostBuffer(nbytes)


def host_free(buf: HostBuffer) -> None:
    """Free memory from host_alloc (by the same backend that allocated it)."""
    if not isinstance(buf, CpuHostBuffer):
        raise InvalidTypeError(
            f"host_free needs a buffer from the cpu backend's host_alloc, got {type(buf).__name__}"
        )
    buf.close()


# ---- addresses -----------------------------------------------------------------------


def get_peer_mem_addr(ptr_or_tensor) -> int:
    """The address a NIC registers: on the CPU, the address itself, once checked mapped."""
    ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
    if ref.device not in ("cpu", "unknown"):
        raise InvalidArgumentError(f"the cpu backend cannot register {ref.device} memory")
    if _mappings.unreadable([(ref.address, ref.nbytes or 1)]) is not None:
        raise InvalidArgumentError(f"address {ref.address:#x} is not mapped in this process")
    return ref.address


# ---- sharing KV-cache buffers between processes --------------------------------------


def set_data_ipc(tensor, name: str) -> None:
    """Share `tensor` (which must live in memory from host_alloc) under `name`."""
    ref = memory_ref(tensor, "tensor")
    if ref.nbytes is None:
        raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
    _sharedhost.publish(ref, name, "cpu")


def share_external_data(like, name: str, shape, timeout: float | None = 60.0):
    """A tensor of `like`'s type and dtype, with `shape`, over the buffer shared as `name`
    (a numpy array, or a Paddle tensor when `like` is one; bfloat16 included)."""
    record, shape, dtype, need = _published.request(like, name, shape, timeout)
    if not _sharedhost.is_host_record(record):
        raise UnsupportedError(
            f"{name!r} is device memory shared by the {record.get('backend')} backend's "
            f"runtime (its IPC handle): the cpu backend maps host memory only; share host "
            f"memory from host_alloc between backends"
        )
    return _sharedhost.import_shared(like, name, record, shape, dtype, need)


def unset_data_ipc(tensor, name: str, close_ipc: bool = True, unlink_shm: bool = True) -> None:
    """Stop sharing `name`: with unlink_shm, remove the record this process published
    (readers of the name then get a clear error; another live publisher's is refused); with
    close_ipc, unmap this process's import of it: ops using it finish first, later ones and
    raw addresses into it are refused, and the mapping goes once no name in its buffer is
    imported and no array share_external_data returned over it is left."""
    _published.unset(name, unlink_shm)  # first: a refusal leaves the mapping as it was
    if close_ipc:
        # copies are done on return here: none can be queued
        _sharedhost.forget(name, _extents.retire)


# ---- host registration and block copies ------------------------------------------------

_registered: dict[int, int] = {}  # address -> nbytes locked by host_register


def host_register(ptr_or_tensor, nbytes: int | None = None) -> None:
    """Lock host memory in RAM (mlock), as a NIC's registration needs it resident."""
    ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
    size = ref.nbytes if nbytes is None else _names.validate_index(nbytes, "nbytes", 1 << 46)
    if not size:
        raise InvalidArgumentError("host_register needs nbytes with a raw address")
    if _mappings.unreadable([(ref.address, size)]) is not None:
        raise InvalidArgumentError(f"[{ref.address:#x}, +{size}) is not mapped in this process")
    if _libc.mlock(ctypes.c_void_p(ref.address), ctypes.c_size_t(size)) != 0:
        err = ctypes.get_errno()
        raise DeviceError(
            f"mlock of {size} bytes at {ref.address:#x} failed: "
            f"{os.strerror(err)} (raise RLIMIT_MEMLOCK: ulimit -l)"
        )
    with _registered_lock:
        _registered[ref.address] = size
    _extents.register(ref.address, size, "cpu", "host_register")


def host_unregister(ptr_or_tensor) -> None:
    """Undo host_register of the same address."""
    address = memory_ref(ptr_or_tensor, "ptr_or_tensor").address
    with _registered_lock:
        size = _registered.pop(address, None)
    if size is None:
        raise InvalidArgumentError(f"{address:#x} was not registered with host_register")
    _extents.retire(address)  # copies are done on return here: none can be queued
    _libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(size))


def copy_blocks(dst, dst_block_ids, src, src_block_ids, block_bytes: int, stream=None) -> int:
    """Copy block src_block_ids[i] of `src` into block dst_block_ids[i] of `dst` (memmove,
    done on return), runs of consecutive ids as one copy; `dst` and `src` may be lists of
    layers, the same ids copied in each. Returns the copies made."""
    return _blocks.copy_blocks(
        0, _host_only, 0, dst, dst_block_ids, src, src_block_ids, block_bytes
    )


def _host_only(dst_device: str, src_device: str) -> int:
    for device in (dst_device, src_device):
        if device not in ("cpu", "unknown"):
            raise InvalidArgumentError(
                f"the cpu backend copies host memory only, got {device} memory"
            )
    return 0


def synchronize(stream=None) -> None:
    """Wait for the work queued on `stream`: on the CPU it is done when queued."""


# ---- signals -------------------------------------------------------------------------


def signal_layer_ready(signal, stream=None, sender: KVSignalSender | None = None) -> None:
    """Mark the layer ready: CPU work before this call is complete, so store now (or, with a
    sender, in order on the sender's thread)."""
    signal = require_signal(signal)
    if signal.segment is None:
        return
    if sender is None:
        signal.publish()
    elif not isinstance(sender, KVSignalSender) or sender.backend != "cpu":
        raise InvalidArgumentError(
            f"sender must come from the cpu backend's create_kv_signal_sender, got {sender!r}"
        )
    else:
        sender.post(None, signal)


def create_kv_signal_sender() -> KVSignalSender:
    """A long-lived sender thread (no device events on the CPU: stores run in order)."""
    return KVSignalSender()


class CpuBackend(Backend):
    name = "cpu"
    priority = 0

    def availability(self) -> Availability:
        return Availability(True, "embedded reference backend")

    def platform(self) -> Platform:
        return CpuPlatform()

    def ops(self) -> dict:
        return {
            "signal_layer_ready": signal_layer_ready,
            "create_kv_signal_sender": create_kv_signal_sender,
            "host_alloc": host_alloc,
            "host_free": host_free,
            "host_register": host_register,
            "host_unregister": host_unregister,
            "get_peer_mem_addr": get_peer_mem_addr,
            "set_data_ipc": set_data_ipc,
            "share_external_data": share_external_data,
            "unset_data_ipc": unset_data_ipc,
            "copy_blocks": copy_blocks,
            "synchronize": synchronize,
        }

    def info(self) -> dict[str, object]:
        return {"runtime": "none (host memory and threads)"}

    def test_support(self):
        from pdhal._backends.cpu.testing import CpuTestSupport

        return CpuTestSupport(host_alloc, host_free)


@hookimpl
def pdhal_backend() -> Backend:
    return CpuBackend()
