"""The `cuda` backend: layer signals as host functions on the stream, GPUDirect addresses,
pinned memory and CUDA IPC. Everything a CUDA runtime shares with other runtimes (binding,
host memory, events and the sender) comes from pdhal.plugin.RuntimeBackend."""

from __future__ import annotations

import sys

from pdhal import InvalidArgumentError
from pdhal.plugin import (
    STORE_CALLBACK_ADDRESS,
    Platform,
    RuntimeBackend,
    free_store,
    memory_ref,
    store_address,
)
from pdhal_cuda._runtime import (
    CUDA_ERROR_INSUFFICIENT_DRIVER,
    CUDA_EVENT_DISABLE_TIMING,
    CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    CUDA_MEMCPY_DEFAULT,
    MEMORY_TYPES,
    CudaRuntime,
)


class CudaPlatform(Platform):
    name = "cuda"
    #: Integers, GPU-<uuid> or MIG-<uuid> entries.
    device_control_env_var = "CUDA_VISIBLE_DEVICES"
    device_kind = "gpu"

    def __init__(self, runtime: CudaRuntime):
        self.runtime = runtime

    def is_device_name(self, entry: str) -> bool:
        """GPU-<uuid> and MIG-<uuid> name devices in CUDA_VISIBLE_DEVICES too."""
        return entry.startswith(("GPU-", "MIG-")) and len(entry) > 4

    def device_count(self) -> int:
        count, rc = self.runtime.device_count()
        self.runtime.check(rc, "cudaGetDeviceCount")  # a failed count is not "no devices"
        return count

    @property
    def capabilities(self) -> dict[str, object]:
        return {
            "host_function": True,
            "async_sender": True,
            "ipc": "cudaIpcMemHandle",
            # an opened IPC allocation's size (cuMemGetAddressRange): a peer's word on a
            # region's size can be checked against it
            "ipc_size": True,
            "pinned_host_memory": True,
            "peer_address": "device address (GPUDirect)",
        }


class CudaBackend(RuntimeBackend):
    name = "cuda"
    priority = 100
    runtime_class = CudaRuntime
    host_alloc_symbol, host_free_symbol = "cudaHostAlloc", "cudaFreeHost"
    event_create_symbol, event_create_args = (
        "cudaEventCreateWithFlags",
        (CUDA_EVENT_DISABLE_TIMING,),
    )
    event_record_symbol, event_wait_symbol = "cudaEventRecord", "cudaEventSynchronize"
    event_query_symbol = "cudaEventQuery"
    event_destroy_symbol = "cudaEventDestroy"
    host_register_symbol, host_unregister_symbol = "cudaHostRegister", "cudaHostUnregister"
    copy_symbol, stream_sync_symbol = "cudaMemcpyAsync", "cudaStreamSynchronize"
    stream_attributes = ("cuda_stream",)
    device_word, device_kind = "GPU", CudaPlatform.device_kind
    ipc_handle_type = "cudaIpcMemHandle_t"
    ipc_get_symbol, ipc_open_symbol = "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle"
    ipc_open_flags, ipc_close_symbol = CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, "cudaIpcCloseMemHandle"

    def device_count_now(self) -> tuple[int, str]:
        count, rc = self.runtime.device_count()
        if rc == CUDA_ERROR_INSUFFICIENT_DRIVER:
            return 0, self.runtime.driver_problem()
        if rc != 0:
            return 0, (
                f"no usable GPU: cudaGetDeviceCount returned "
                f"{self.runtime.error_text(rc)} ({self.runtime.path})"
            )
        return count, ""

    def platform(self) -> Platform:
        return CudaPlatform(self.runtime)

    def test_support(self):
        from pdhal_cuda.testing import CudaTestSupport

        return CudaTestSupport(self.runtime.path)

    # ---- signals -------------------------------------------------------------------

    def framework_stream(self):
        """Paddle's current stream, if Paddle is already imported and built with CUDA."""
        paddle = sys.modules.get("paddle")
        if paddle is None or not paddle.is_compiled_with_cuda():
            return None
        return paddle.device.current_stream()

    def signal_without_sender(self, signal, stream) -> None:
        """cudaLaunchHostFunc runs pdhal's C store on the stream, with no Python and no GIL;
        the store owns its own copy of what to write, so the engine may free its per-step
        buffers at once."""
        rt = self.runtime
        handle = rt.pointer(self.stream_handle(stream))
        store = signal.new_store()
        rc = rt.lib.cudaLaunchHostFunc(
            handle,
            rt.ffi.cast("cudaHostFn_t", STORE_CALLBACK_ADDRESS),
            rt.pointer(store_address(store)),
        )
        if rc != 0:
            free_store(store)
            rt.check(rc, "cudaLaunchHostFunc")

    # ---- memory --------------------------------------------------------------------

    def _memory_type(self, address: int) -> str:
        rt = self.runtime
        attrs = rt.ffi.new("struct cudaPointerAttributes *")
        rt.check(
            rt.lib.cudaPointerGetAttributes(attrs, rt.pointer(address)), "cudaPointerGetAttributes"
        )
        return MEMORY_TYPES.get(attrs.type, f"type {attrs.type}")

    def get_peer_mem_addr(self, ptr_or_tensor) -> int:
        """The address a GPUDirect NIC registers: the device (or registered host) address
        itself, once cudaPointerGetAttributes confirms CUDA knows the memory."""
        ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
        kind = self._memory_type(ref.address)
        if kind not in ("device", "host", "managed"):
            raise InvalidArgumentError(
                f"memory at {ref.address:#x} is {kind} for CUDA: a NIC can register device "
                f"memory or cudaHostAlloc/registered host memory only"
            )
        return ref.address

    def ipc_base(self, ref) -> int:
        """A CUDA IPC handle names the whole device allocation: its base (the tensor's
        offset inside it travels in the record). Only device memory can be shared."""
        kind = self._memory_type(ref.address)
        if kind != "device":
            raise InvalidArgumentError(
                f"set_data_ipc needs CUDA device memory; {ref.address:#x} is {kind}"
            )
        return self.runtime.address_range(ref.address)[0]

    def ipc_size(self, base: int) -> int:
        return self.runtime.address_range(base)[1]

    def current_device(self) -> int:
        device = self.runtime.ffi.new("int *")
        self.runtime.check(self.runtime.lib.cudaGetDevice(device), "cudaGetDevice")
        return device[0]

    # ---- block copies --------------------------------------------------------------

    def copy_kind(self, dst_device: str, src_device: str) -> int:
        """Any direction: unified addressing tells the runtime which it is."""
        return CUDA_MEMCPY_DEFAULT
