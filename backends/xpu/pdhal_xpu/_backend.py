"""The `xpu` backend: layer signals through the async sender, peer aliases, XPU memory.

The module-level functions named in BACKEND_OPS (destroy_kv_signal_sender imported) are
the backend's ops (Backend.ops).
"""

from __future__ import annotations

import sys

from pdhal import InvalidArgumentError, InvalidTypeError
from pdhal.plugin import (
    Availability,
    Backend,
    HostBuffer,
    KVSignalSender,
    Platform,
    ProcessSender,
    SharedDeviceBuffer,
    destroy_kv_signal_sender,
    memory_ref,
    publish_shared,
    request_shared,
    require_signal,
    validate_index,
)

_runtime = None  # the XpuRuntime, bound when the backend is first asked about availability


class XpuPlatform(Platform):
    name = "xpu"
    #: Kunlunxin's visibility variable (ids or nothing else).
    device_control_env_var = "XPU_VISIBLE_DEVICES"

    def device_count(self) -> int:
        return _runtime.device_count()

    @property
    def capabilities(self) -> dict[str, object]:
        rt = _runtime
        return {
            "host_function": False,
            "async_sender": True,
            "ipc": "xpu_ipc_memhandle" if rt.has("xpu_ipc_get_memhandle") else False,
            "pinned_host_memory": True,
            "peer_address": "cudaPointerGetAttributes.hostPointer"
            if rt.has("cudaPointerGetAttributes") else False,
        }


# ---- streams and signals -------------------------------------------------------------

def stream_handle(stream) -> int:
    """The XPUStream address of `stream`: an int handle, an object exposing `xpu_stream` or
    `raw_stream`, or None for Paddle's current XPU stream (if Paddle is already imported and
    built for XPU), else the default stream (0)."""
    if stream is None:
        paddle = sys.modules.get("paddle")
        if paddle is not None and paddle.is_compiled_with_xpu():
            current = paddle.device.current_stream()
            stream = getattr(current, "stream_base", current)
        else:
            return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise InvalidArgumentError(f"stream handle must be >= 0, got {stream}")
        return stream
    for attr in ("xpu_stream", "raw_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise InvalidTypeError(f"stream must be an int XPUStream handle or expose xpu_stream / "
                           f"raw_stream, got {type(stream).__name__}")


def create_kv_signal_sender() -> KVSignalSender:
    """A long-lived sender thread that waits on XPU events with xpu_event_wait."""
    rt = _runtime
    return KVSignalSender(rt.address(rt.lib.xpu_event_wait),
                          rt.address(rt.lib.xpu_event_destroy), backend="xpu")


_default_sender = ProcessSender(create_kv_signal_sender)


def signal_layer_ready(signal, stream=None, sender: KVSignalSender | None = None) -> None:
    """Record an event on `stream` after the layer's work; the sender thread stores the
    signal once the event fires (the process's default sender if none is given)."""
    require_signal(signal)
    if signal.segment is None:
        return
    if sender is None:
        sender = _default_sender.get()
    elif not isinstance(sender, KVSignalSender) or sender.backend != "xpu":
        raise InvalidArgumentError(f"sender must come from the xpu backend's "
                                   f"create_kv_signal_sender, got {sender!r}")
    rt = _runtime
    event = rt.ffi.new("XPUEvent *")
    rt.check(rt.lib.xpu_event_create(event), "xpu_event_create")
    rc = rt.lib.xpu_event_record(event[0], rt.pointer(stream_handle(stream)))
    if rc != 0:
        rt.lib.xpu_event_destroy(event[0])
        rt.check(rc, "xpu_event_record")
    sender.post(rt.address(event[0]), signal)


# ---- memory --------------------------------------------------------------------------

class XpuHostBuffer(HostBuffer):
    """Pinned host memory from xpu_host_alloc, returned with xpu_host_free."""

    def _release(self) -> None:
        rt = _runtime
        rt.check(rt.lib.xpu_host_free(rt.pointer(self._address)), "xpu_host_free")


def host_alloc(nbytes: int) -> XpuHostBuffer:
    """Pinned host memory from the XPU runtime."""
    nbytes = validate_index(nbytes, "nbytes", 1 << 46)
    if nbytes == 0:
        raise InvalidArgumentError("nbytes must be at least 1")
    rt = _runtime
    ptr = rt.ffi.new("void **")
    rt.check(rt.lib.xpu_host_alloc(ptr, nbytes, 0), f"xpu_host_alloc({nbytes})")
    return XpuHostBuffer(rt.address(ptr[0]), nbytes, pinned=True)


def host_free(buf: HostBuffer) -> None:
    """Free memory from host_alloc, through the runtime that allocated it."""
    if not isinstance(buf, XpuHostBuffer):
        raise InvalidTypeError(f"host_free needs a buffer from the xpu backend's host_alloc, "
                               f"got {type(buf).__name__}")
    buf.close()


def get_peer_mem_addr(ptr_or_tensor) -> int:
    """The peer alias of XPU device memory that an RDMA NIC can register
    (cudaPointerGetAttributes' hostPointer)."""
    ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
    rt = _runtime
    get_attributes = rt.optional("cudaPointerGetAttributes")
    attrs = rt.ffi.new("struct cudaPointerAttributes *")
    rt.check(get_attributes(attrs, rt.pointer(ref.address)), "cudaPointerGetAttributes")
    if attrs.hostPointer == rt.ffi.NULL:
        raise InvalidArgumentError(
            f"memory at {ref.address:#x} has no peer address: the XPU runtime does not know it "
            f"as device memory, so a NIC cannot register it")
    return rt.address(attrs.hostPointer)


def set_data_ipc(tensor, name: str) -> None:
    """Share XPU device memory under `name` through an XPU IPC handle."""
    ref = memory_ref(tensor, "tensor")
    if ref.nbytes is None:
        raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
    rt = _runtime
    get_handle = rt.optional("xpu_ipc_get_memhandle")
    handle = rt.ffi.new("XPUIpcMemHandle *")
    rt.check(get_handle(handle, rt.pointer(ref.address)), "xpu_ipc_get_memhandle")
    publish_shared(name, {"handle": bytes(rt.ffi.buffer(handle)).hex(), "nbytes": ref.nbytes})


def share_external_data(like, name: str, shape, timeout: float | None = 60.0):
    """Map the XPU memory shared as `name`; returns a SharedDeviceBuffer of `like`'s dtype."""
    record, shape, dtype, need = request_shared(like, name, shape, timeout)
    rt = _runtime
    open_handle = rt.optional("xpu_ipc_open_memhandle")
    handle = rt.ffi.new("XPUIpcMemHandle *")
    rt.ffi.buffer(handle)[:] = bytes.fromhex(record["handle"])
    ptr = rt.ffi.new("void **")
    rt.check(open_handle(ptr, handle[0], 0), "xpu_ipc_open_memhandle")
    return SharedDeviceBuffer(rt.address(ptr[0]), shape, dtype, need)


class XpuBackend(Backend):
    name = "xpu"
    priority = 100

    def availability(self) -> Availability:
        from pdhal_xpu._runtime import XpuRuntime, find_library

        global _runtime
        if _runtime is None or _runtime.path != find_library()[0]:
            _runtime = None
            try:
                _runtime = XpuRuntime()
            except OSError as e:
                return Availability(False, f"XPU runtime not loadable: {e}")
        try:
            count = _runtime.device_count()
        except Exception as e:
            return Availability(False, f"xpu_device_count failed: {e}")
        if count == 0:
            return Availability(False, f"no XPU device ({_runtime.path})")
        return Availability(True, f"{count} XPU device(s)")

    def platform(self) -> Platform:
        return XpuPlatform()


    def info(self) -> dict[str, object]:
        return {} if _runtime is None else _runtime.describe()

    def test_support(self):
        from pdhal_xpu.testing import XpuTestSupport

        return XpuTestSupport(_runtime.path)
