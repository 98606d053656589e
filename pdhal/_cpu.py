"""The `cpu` reference backend: embedded, always available, real implementations.

Work submitted "to a stream" on the CPU is already done when the call returns, so a layer
signal is stored at once (or, with a sender, as soon as the sender thread reaches it). Host
memory is a pdhal shared-memory segment, locked in RAM when RLIMIT_MEMLOCK allows, which is
also what makes it shareable with set_data_ipc. CpuBackend.ops() names the functions below.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import itertools
import os
import threading

from pdhal import _core, _names, _published
from pdhal._backend import Availability, Backend
from pdhal._errors import InvalidArgumentError, InvalidTypeError, UnsupportedError
from pdhal._hookspecs import hookimpl
from pdhal._hostmem import HostBuffer
from pdhal._platform import Platform
from pdhal._sender import KVSignalSender, require_signal
from pdhal._tensors import is_paddle_tensor, memory_ref


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

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_counter = itertools.count()
_live_buffers: dict[int, CpuHostBuffer] = {}  # address -> buffer, for set_data_ipc
_live_lock = threading.Lock()


def _memlock_allowed() -> bool:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY or soft >= (1 << 20)


class CpuHostBuffer(HostBuffer):
    """Host memory in a pdhal shared-memory segment, mlock'ed when the limit allows."""

    def __init__(self, nbytes: int):
        name = f"host.{os.getpid()}.{next(_counter)}"
        self._segment = _core.Segment.create(_names.buffer_path(name), _core.KIND_BUFFER,
                                             body_bytes=nbytes)
        address = self._segment.body_address()
        pinned = _libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0
        super().__init__(address, nbytes, pinned)
        self.path = self._segment.path
        with _live_lock:
            _live_buffers[address] = self

    def _release(self) -> None:
        address = self._address
        with _live_lock:
            _live_buffers.pop(address, None)
        _published.unpublish_where(lambda record: record.get("path") == self.path)
        if self.pinned:
            _libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(self.nbytes))
        self._segment.close()


def host_alloc(nbytes: int) -> CpuHostBuffer:
    """Allocate `nbytes` of pinned (when permitted), shareable host memory."""
    nbytes = _names.validate_index(nbytes, "nbytes", 1 << 46)
    if nbytes == 0:
        raise InvalidArgumentError("nbytes must be at least 1")
    # Locking pages means touching them all: a request beyond RAM would grind, not fail.
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > ram:
        raise InvalidArgumentError(f"nbytes {nbytes} is more than this machine's memory "
                                   f"({ram} bytes)")
    return CpuHostBuffer(nbytes)


def host_free(buf: HostBuffer) -> None:
    """Free memory from host_alloc (by the same backend that allocated it)."""
    if not isinstance(buf, CpuHostBuffer):
        raise InvalidTypeError(f"host_free needs a buffer from the cpu backend's host_alloc, got "
                               f"{type(buf).__name__}")
    buf.close()


def _owning_buffer(address: int, nbytes: int) -> CpuHostBuffer | None:
    with _live_lock:
        starts = sorted(_live_buffers)
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and _live_buffers[starts[i]].contains(address, nbytes):
            return _live_buffers[starts[i]]
    return None


# ---- addresses -----------------------------------------------------------------------

def _mapped(address: int, nbytes: int) -> bool:
    """Is [address, address + nbytes) inside this process's mappings?"""
    end = address + nbytes
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            if lo <= address < hi:
                if end <= hi:
                    return True
                address = hi  # continues into the next mapping, if contiguous
    return False


def get_peer_mem_addr(ptr_or_tensor) -> int:
    """The address a NIC registers: on the CPU, the address itself, once checked mapped."""
    ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
    if ref.device not in ("cpu", "unknown"):
        raise InvalidArgumentError(f"the cpu backend cannot register {ref.device} memory")
    if not _mapped(ref.address, ref.nbytes or 1):
        raise InvalidArgumentError(f"address {ref.address:#x} is not mapped in this process")
    return ref.address


# ---- sharing KV-cache buffers between processes --------------------------------------

_imported: dict[str, _core.Segment] = {}  # mappings stay for the process's life, like CUDA IPC


def set_data_ipc(tensor, name: str) -> None:
    """Share `tensor` (which must live in memory from host_alloc) under `name`."""
    ref = memory_ref(tensor, "tensor")
    if ref.nbytes is None:
        raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
    owner = _owning_buffer(ref.address, ref.nbytes)
    if owner is None:
        raise UnsupportedError(
            f"the cpu backend can only share memory allocated by pdhal: allocate the KV cache "
            f"with pdhal.ops.host_alloc and view it as a tensor (address {ref.address:#x} is not "
            f"inside any live host_alloc buffer)")
    _published.publish(name, {"path": owner.path, "offset": ref.address - owner.address,
                              "nbytes": ref.nbytes})


def share_external_data(like, name: str, shape, timeout: float | None = 60.0):
    """A tensor of `like`'s type and dtype, with `shape`, over the buffer shared as `name`."""
    import numpy as np

    record, shape, dtype, need = _published.request(like, name, shape, timeout)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise UnsupportedError(f"the cpu backend maps shared buffers through numpy, which has "
                               f"no dtype {dtype}") from None
    seg = _imported.get(record["path"])
    if seg is None:
        seg = _imported[record["path"]] = _core.Segment.open(record["path"], _core.KIND_BUFFER,
                                                             timeout)
    view = memoryview(seg.body())[record["offset"]:record["offset"] + need]
    array = np.frombuffer(view, dtype=dtype).reshape(shape)
    if is_paddle_tensor(like):
        import paddle

        return paddle.from_dlpack(array)
    return array


# ---- signals -------------------------------------------------------------------------

def signal_layer_ready(signal, stream=None, sender: KVSignalSender | None = None) -> None:
    """Mark the layer ready: CPU work before this call is complete, so store now (or, with a
    sender, in order on the sender's thread)."""
    require_signal(signal)
    if signal.segment is None:
        return
    if sender is None:
        signal.segment.publish(signal.slot, signal.value)
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
        return {"signal_layer_ready": signal_layer_ready,
                "create_kv_signal_sender": create_kv_signal_sender,
                "host_alloc": host_alloc, "host_free": host_free,
                "get_peer_mem_addr": get_peer_mem_addr, "set_data_ipc": set_data_ipc,
                "share_external_data": share_external_data}

    def info(self) -> dict[str, object]:
        return {"runtime": "none (host memory and threads)"}

    def test_support(self):
        from pdhal.testing.cpu import CpuTestSupport

        return CpuTestSupport()


@hookimpl
def pdhal_backend() -> Backend:
    return CpuBackend()
