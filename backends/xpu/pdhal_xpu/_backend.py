"""The `xpu` backend: layer signals through the async sender, peer aliases, XPU memory.
Everything an XPU runtime shares with other runtimes (binding, host memory, events and the
sender) comes from pdhal.plugin.RuntimeBackend."""

from __future__ import annotations

import sys

from pdhal import InvalidArgumentError, InvalidTypeError
from pdhal.plugin import (
    Platform,
    ProcessSender,
    RuntimeBackend,
    memory_ref,
    publish_shared,
    request_shared,
    require_signal,
    unset_shared,
)
from pdhal_xpu._runtime import (
    XPU_DEVICE_TO_DEVICE,
    XPU_DEVICE_TO_HOST,
    XPU_HOST_TO_DEVICE,
    XpuRuntime,
)


class XpuPlatform(Platform):
    name = "xpu"
    #: Kunlunxin's visibility variable (ids or nothing else).
    device_control_env_var = "XPU_VISIBLE_DEVICES"
    paddle_device_type, paddle_device_module = "xpu", "paddle.device.xpu"

    def __init__(self, runtime: XpuRuntime):
        self.runtime = runtime

    def device_count(self) -> int:
        return self.runtime.device_count()

    @property
    def capabilities(self) -> dict[str, object]:
        rt = self.runtime
        return {
            "host_function": False,
            "async_sender": True,
            "ipc": "xpu_ipc_memhandle" if rt.has("xpu_ipc_get_memhandle") else False,
            "pinned_host_memory": True,
            "peer_address": "cudaPointerGetAttributes.hostPointer"
            if rt.has("cudaPointerGetAttributes")
            else False,
        }


class XpuBackend(RuntimeBackend):
    name = "xpu"
    priority = 100
    runtime_class = XpuRuntime
    host_alloc_symbol, host_free_symbol = "xpu_host_alloc", "xpu_host_free"
    event_create_symbol, event_record_symbol = "xpu_event_create", "xpu_event_record"
    event_wait_symbol, event_destroy_symbol = "xpu_event_wait", "xpu_event_destroy"
    event_query_symbol = "xpu_event_query"
    # host registration is in the runtime's CUDA-compatible layer (KL3 runtimes)
    host_register_symbol, host_unregister_symbol = "cudaHostRegister", "cudaHostUnregister"
    copy_symbol, stream_sync_symbol = "xpu_memcpy_async", "xpu_wait"
    stream_attributes = ("xpu_stream", "raw_stream")
    device_word, device_kind = "XPU device", "xpu"

    def __init__(self):
        super().__init__()
        #: The sender a signal goes through when the engine passes none (XPU has no host
        #: functions): one per process, created on first use, flushed at exit.
        self.default_sender = ProcessSender(self.create_kv_signal_sender)
        self._opened: dict[str, int] = {}  # IPC handle -> mapped address: opened once
        self._imports: dict[str, tuple[str, int]] = {}  # name -> (IPC handle, address)

    def device_count_now(self) -> tuple[int, str]:
        try:
            return self.runtime.device_count(), ""
        except Exception as e:  # detection says "no" with the reason, never raises
            return 0, str(e)

    def platform(self) -> Platform:
        return XpuPlatform(self.runtime)

    def ops(self) -> dict:
        return {
            "signal_layer_ready": self.signal_layer_ready,
            "create_kv_signal_sender": self.create_kv_signal_sender,
            "host_alloc": self.host_alloc,
            "host_free": self.host_free,
            "host_register": self.host_register,
            "host_unregister": self.host_unregister,
            "get_peer_mem_addr": self.get_peer_mem_addr,
            "set_data_ipc": self.set_data_ipc,
            "share_external_data": self.share_external_data,
            "unset_data_ipc": self.unset_data_ipc,
            "copy_blocks": self.copy_blocks,
            "synchronize": self.synchronize,
        }

    def test_support(self):
        from pdhal_xpu.testing import XpuTestSupport

        return XpuTestSupport(self.runtime.path)

    # ---- signals -------------------------------------------------------------------

    def framework_stream(self):
        """Paddle's current XPU stream, if Paddle is already imported and built for XPU."""
        paddle = sys.modules.get("paddle")
        if paddle is None or not paddle.is_compiled_with_xpu():
            return None
        current = paddle.device.current_stream()
        return getattr(current, "stream_base", current)

    def signal_layer_ready(self, signal, stream=None, sender=None) -> None:
        """Record an event on `stream` after the layer's work; the sender thread stores the
        signal once the event fires (the process's default sender if none is given)."""
        signal = require_signal(signal)
        if signal.segment is None:
            return
        sender = self.default_sender.get() if sender is None else self.require_sender(sender)
        self.post_behind_event(signal, stream, sender)

    # ---- memory --------------------------------------------------------------------

    def get_peer_mem_addr(self, ptr_or_tensor) -> int:
        """The peer alias of XPU device memory that an RDMA NIC can register
        (cudaPointerGetAttributes' hostPointer)."""
        ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
        rt = self.runtime
        get_attributes = rt.optional("cudaPointerGetAttributes")
        attrs = rt.ffi.new("struct cudaPointerAttributes *")
        rt.check(get_attributes(attrs, rt.pointer(ref.address)), "cudaPointerGetAttributes")
        if attrs.hostPointer == rt.ffi.NULL:
            raise InvalidArgumentError(
                f"memory at {ref.address:#x} has no peer address: the XPU runtime does not "
                f"know it as device memory, so a NIC cannot register it"
            )
        return rt.address(attrs.hostPointer)

    def set_data_ipc(self, tensor, name: str) -> None:
        """Share XPU device memory under `name` through an XPU IPC handle."""
        ref = memory_ref(tensor, "tensor")
        if ref.nbytes is None:
            raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
        rt = self.runtime
        get_handle = rt.optional("xpu_ipc_get_memhandle")
        handle = rt.ffi.new("XPUIpcMemHandle *")
        rt.check(get_handle(handle, rt.pointer(ref.address)), "xpu_ipc_get_memhandle")
        publish_shared(name, {"handle": bytes(rt.ffi.buffer(handle)).hex(), "nbytes": ref.nbytes})

    def share_external_data(self, like, name: str, shape, timeout: float | None = 60.0):
        """Map the XPU memory shared as `name`; a SharedDeviceBuffer of `like`'s dtype."""
        record, shape, dtype, need = request_shared(like, name, shape, timeout)
        rt = self.runtime
        address = self._opened.get(record["handle"])
        if address is None:
            open_handle = rt.optional("xpu_ipc_open_memhandle")
            handle = rt.ffi.new("XPUIpcMemHandle *")
            rt.ffi.buffer(handle)[:] = bytes.fromhex(record["handle"])
            ptr = rt.ffi.new("void **")
            rt.check(open_handle(ptr, handle[0], 0), "xpu_ipc_open_memhandle")
            address = self._opened[record["handle"]] = rt.address(ptr[0])
        self._imports[name] = (record["handle"], address)
        return self.mapped(address, shape, dtype, need, name)

    def unset_data_ipc(
        self, tensor, name: str, close_ipc: bool = True, unlink_shm: bool = True
    ) -> None:
        """Stop sharing `name`: with close_ipc, unmap this process's import of it (where the
        runtime can: xpu_ipc_close_memhandle); with unlink_shm, remove the record (this
        process's own; another live publisher's is refused)."""
        unset_shared(name, unlink_shm)  # first: a refusal leaves the mapping as it was
        if close_ipc and name in self._imports:
            handle, address = self._imports.pop(name)
            self.unmapping(address)
            rt = self.runtime
            if all(h != handle for h, _ in self._imports.values()):  # its last import
                del self._opened[handle]
                if rt.has("xpu_ipc_close_memhandle"):
                    rt.check(
                        rt.lib.xpu_ipc_close_memhandle(rt.pointer(address)),
                        "xpu_ipc_close_memhandle",
                    )

    def current_device(self) -> int:
        device = self.runtime.ffi.new("int *")
        self.runtime.check(self.runtime.lib.xpu_current_device(device), "xpu_current_device")
        return device[0]

    # ---- block copies --------------------------------------------------------------

    def copy_kind(self, dst_device: str, src_device: str) -> int:
        """XPUMemcpyKind from where each side lives (host memory: "cpu")."""
        on_device = (dst_device.startswith("xpu"), src_device.startswith("xpu"))
        kinds = {
            (True, True): XPU_DEVICE_TO_DEVICE,
            (True, False): XPU_HOST_TO_DEVICE,
            (False, True): XPU_DEVICE_TO_HOST,
        }
        if on_device not in kinds:
            raise InvalidArgumentError(
                "the xpu backend copies to or from XPU memory; both sides are host memory here"
            )
        return kinds[on_device]
