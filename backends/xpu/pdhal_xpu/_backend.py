"""The `xpu` backend: layer signals through the async sender, peer aliases, XPU memory.
Everything an XPU runtime shares with other runtimes (binding, host memory, events and the
sender) comes from pdhal.plugin.RuntimeBackend."""

from __future__ import annotations

import sys

from pdhal import InvalidArgumentError
from pdhal.plugin import (
    Platform,
    ProcessSender,
    RuntimeBackend,
    memory_ref,
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
    device_kind = "xpu"

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
            "ipc_size": False,  # no call says how large an opened IPC allocation is
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
    device_word, device_kind = "XPU device", XpuPlatform.device_kind
    # an XPU IPC handle names the pointer itself; closing needs a runtime that has the call
    ipc_handle_type = "XPUIpcMemHandle"
    ipc_get_symbol, ipc_open_symbol = "xpu_ipc_get_memhandle", "xpu_ipc_open_memhandle"
    ipc_close_symbol = "xpu_ipc_close_memhandle"

    def __init__(self):
        super().__init__()
        #: The sender a signal goes through when the engine passes none (XPU has no host
        #: functions): one per process, created on first use, flushed at exit.
        self.default_sender = ProcessSender(self.create_kv_signal_sender)

    def device_count_now(self) -> tuple[int, str]:
        try:
            return self.runtime.device_count(), ""
        except Exception as e:  # detection says "no" with the reason, never raises
            return 0, str(e)

    def platform(self) -> Platform:
        return XpuPlatform(self.runtime)

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

    def signal_without_sender(self, signal, stream) -> None:
        """XPU has no host functions: the process's default sender stores the signal once
        an event recorded on `stream` fires."""
        self.post_behind_event(signal, stream, self.default_sender.get())

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
