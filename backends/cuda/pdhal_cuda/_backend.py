"""The `cuda` backend: layer signals as host functions on the stream, GPUDirect addresses,
pinned memory and CUDA IPC. Everything a CUDA runtime shares with other runtimes (binding,
host memory, events and the sender) comes from pdhal.plugin.RuntimeBackend."""

from __future__ import annotations

import sys

from pdhal import InvalidArgumentError, InvalidTypeError
from pdhal.plugin import (
    STORE_CALLBACK_ADDRESS,
    Platform,
    RuntimeBackend,
    free_store,
    memory_ref,
    publish_shared,
    request_shared,
    require_signal,
    store_address,
    unset_shared,
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
    paddle_device_type, paddle_device_module = "gpu", "paddle.device.cuda"

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
    device_word, device_kind = "GPU", "gpu"

    def __init__(self):
        super().__init__()
        self._opened: dict[str, int] = {}  # IPC handle -> mapped base: CUDA opens one once
        self._imports: dict[str, tuple[str, int]] = {}  # name -> (IPC handle, address)

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
        from pdhal_cuda.testing import CudaTestSupport

        return CudaTestSupport(self.runtime.path)

    # ---- signals -------------------------------------------------------------------

    def framework_stream(self):
        """Paddle's current stream, if Paddle is already imported and built with CUDA."""
        paddle = sys.modules.get("paddle")
        if paddle is None or not paddle.is_compiled_with_cuda():
            return None
        return paddle.device.current_stream()

    def signal_layer_ready(self, signal, stream=None, sender=None) -> None:
        """Make the layer count as ready once the work queued on `stream` so far has finished.

        Without a sender: cudaLaunchHostFunc runs pdhal's C store on the stream, with no
        Python and no GIL; the store owns its own copy of what to write, so the engine may
        free its per-step buffers at once. With a sender: an event recorded on the stream,
        waited for on the sender's thread."""
        signal = require_signal(signal)
        if signal.segment is None:
            return
        if sender is not None:
            self.post_behind_event(signal, stream, self.require_sender(sender))
            return
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

    def set_data_ipc(self, tensor, name: str) -> None:
        """Share CUDA device memory under `name` through a CUDA IPC handle (plus the
        tensor's offset inside its allocation, since a handle names the whole allocation)."""
        ref = memory_ref(tensor, "tensor")
        if ref.nbytes is None:
            raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
        rt = self.runtime
        kind = self._memory_type(ref.address)
        if kind != "device":
            raise InvalidArgumentError(
                f"set_data_ipc needs CUDA device memory; {ref.address:#x} is {kind}"
            )
        base, _ = rt.address_range(ref.address)
        handle = rt.ffi.new("cudaIpcMemHandle_t *")
        rt.check(rt.lib.cudaIpcGetMemHandle(handle, rt.pointer(ref.address)), "cudaIpcGetMemHandle")
        publish_shared(
            name,
            {
                "handle": bytes(rt.ffi.buffer(handle)).hex(),
                "nbytes": ref.nbytes,
                "offset": ref.address - base,
            },
        )

    def share_external_data(self, like, name: str, shape, timeout: float | None = 60.0):
        """Map the CUDA memory shared as `name` (at its offset); a SharedDeviceBuffer of
        `like`'s dtype and `shape`."""
        record, shape, dtype, need = request_shared(like, name, shape, timeout)
        rt = self.runtime
        base = self._opened.get(record["handle"])
        if base is None:
            handle = rt.ffi.new("cudaIpcMemHandle_t *")
            rt.ffi.buffer(handle)[:] = bytes.fromhex(record["handle"])
            ptr = rt.ffi.new("void **")
            rt.check(
                rt.lib.cudaIpcOpenMemHandle(ptr, handle[0], CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                "cudaIpcOpenMemHandle",
            )
            base = self._opened[record["handle"]] = rt.address(ptr[0])
        self._imports[name] = (record["handle"], base + record["offset"])
        return self.mapped(base + record["offset"], shape, dtype, need, name)

    def unset_data_ipc(
        self, tensor, name: str, close_ipc: bool = True, unlink_shm: bool = True
    ) -> None:
        """Stop sharing `name`: with close_ipc, unmap this process's import of it
        (cudaIpcCloseMemHandle: views of it are invalid afterwards); with unlink_shm, remove
        the record (this process's own; another live publisher's is refused)."""
        unset_shared(name, unlink_shm)  # first: a refusal leaves the mapping as it was
        if close_ipc and name in self._imports:
            handle, address = self._imports.pop(name)
            self.unmapping(address)
            if all(h != handle for h, _ in self._imports.values()):  # its last import
                rt = self.runtime
                rt.check(
                    rt.lib.cudaIpcCloseMemHandle(rt.pointer(self._opened.pop(handle))),
                    "cudaIpcCloseMemHandle",
                )

    def current_device(self) -> int:
        device = self.runtime.ffi.new("int *")
        self.runtime.check(self.runtime.lib.cudaGetDevice(device), "cudaGetDevice")
        return device[0]

    # ---- block copies --------------------------------------------------------------

    def copy_kind(self, dst_device: str, src_device: str) -> int:
        """Any direction: unified addressing tells the runtime which it is."""
        return CUDA_MEMCPY_DEFAULT
