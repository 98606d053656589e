"""The `cuda` backend: layer signals as host functions on the stream, GPUDirect addresses,
pinned memory and CUDA IPC.

The module-level functions named in BACKEND_OPS (destroy_kv_signal_sender imported) are
the backend's ops (Backend.ops).
"""

from __future__ import annotations

import sys

from pdhal import InvalidArgumentError, InvalidTypeError
from pdhal.plugin import (
    STORE_CALLBACK_ADDRESS,
    Availability,
    Backend,
    HostBuffer,
    KVSignalSender,
    Platform,
    ProcessSender,
    SharedDeviceBuffer,
    destroy_kv_signal_sender,
    free_store,
    memory_ref,
    publish_shared,
    request_shared,
    require_signal,
    store_address,
    validate_index,
)
from pdhal_cuda._runtime import (
    CUDA_EVENT_DISABLE_TIMING,
    CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    MEMORY_TYPES,
    CudaRuntime,
    find_library,
)

_runtime = None  # the CudaRuntime, bound when the backend is first asked about availability


class CudaPlatform(Platform):
    name = "cuda"
    #: Integers, GPU-<uuid> or MIG-<uuid> entries.
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    def device_count(self) -> int:
        count, rc = _runtime.device_count()
        _runtime.check(rc, "cudaGetDeviceCount")  # a failed count is not "no devices"
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


# ---- streams and signals -------------------------------------------------------------

def stream_handle(stream) -> int:
    """The cudaStream_t address of `stream`: an int handle, an object exposing `cuda_stream`
    (torch, cupy, paddle streams), or None for Paddle's current stream (if Paddle is already
    imported and built with CUDA), else the legacy default stream (0)."""
    if stream is None:
        paddle = sys.modules.get("paddle")
        if paddle is None or not paddle.is_compiled_with_cuda():
            return 0
        stream = paddle.device.current_stream()
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise InvalidArgumentError(f"stream handle must be >= 0, got {stream}")
        return stream
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    raise InvalidTypeError(f"stream must be an int cudaStream_t or expose cuda_stream, got "
                           f"{type(stream).__name__}")


def create_kv_signal_sender() -> KVSignalSender:
    """A long-lived sender thread that waits on CUDA events (cudaEventSynchronize). The
    default path, without a sender, is a host function on the stream."""
    rt = _runtime
    return KVSignalSender(rt.address(rt.lib.cudaEventSynchronize),
                          rt.address(rt.lib.cudaEventDestroy), backend="cuda")


_default_sender = ProcessSender(create_kv_signal_sender)


def signal_layer_ready(signal, stream=None, sender: KVSignalSender | None = None) -> None:
    """Make the layer count as ready once the work queued on `stream` so far has finished.

    Without a sender: cudaLaunchHostFunc runs pdhal's C store on the stream, with no Python
    and no GIL; the store owns its own copy of what to write, so the engine may free its
    per-step buffers at once. With a sender: an event recorded on the stream, waited for on
    the sender's thread."""
    require_signal(signal)
    if signal.segment is None:
        return
    rt = _runtime
    handle = rt.pointer(stream_handle(stream))
    if sender is None:
        store = signal.new_store()
        rc = rt.lib.cudaLaunchHostFunc(handle, rt.ffi.cast("cudaHostFn_t", STORE_CALLBACK_ADDRESS),
                                       rt.pointer(store_address(store)))
        if rc != 0:
            free_store(store)
            rt.check(rc, "cudaLaunchHostFunc")
        return
    if not isinstance(sender, KVSignalSender) or sender.backend != "cuda":
        raise InvalidArgumentError(f"sender must come from the cuda backend's "
                                   f"create_kv_signal_sender, got {sender!r}")
    event = rt.ffi.new("cudaEvent_t *")
    rt.check(rt.lib.cudaEventCreateWithFlags(event, CUDA_EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags")
    rc = rt.lib.cudaEventRecord(event[0], handle)
    if rc != 0:
        rt.lib.cudaEventDestroy(event[0])
        rt.check(rc, "cudaEventRecord")
    sender.post(rt.address(event[0]), signal)


# ---- memory --------------------------------------------------------------------------

class CudaHostBuffer(HostBuffer):
    """Pinned host memory from cudaHostAlloc, returned with cudaFreeHost."""

    def _release(self) -> None:
        _runtime.check(_runtime.lib.cudaFreeHost(_runtime.pointer(self._address)),
                       "cudaFreeHost")


def host_alloc(nbytes: int) -> CudaHostBuffer:
    """Pinned host memory from cudaHostAlloc."""
    nbytes = validate_index(nbytes, "nbytes", 1 << 46)
    if nbytes == 0:
        raise InvalidArgumentError("nbytes must be at least 1")
    rt = _runtime
    ptr = rt.ffi.new("void **")
    rt.check(rt.lib.cudaHostAlloc(ptr, nbytes, 0), f"cudaHostAlloc({nbytes})")
    return CudaHostBuffer(rt.address(ptr[0]), nbytes, pinned=True)


def host_free(buf: HostBuffer) -> None:
    """Free memory from host_alloc with cudaFreeHost."""
    if not isinstance(buf, CudaHostBuffer):
        raise InvalidTypeError(f"host_free needs a buffer from the cuda backend's host_alloc, "
                               f"got {type(buf).__name__}")
    buf.close()


def _memory_type(address: int) -> str:
    rt = _runtime
    attrs = rt.ffi.new("struct cudaPointerAttributes *")
    rt.check(rt.lib.cudaPointerGetAttributes(attrs, rt.pointer(address)),
             "cudaPointerGetAttributes")
    return MEMORY_TYPES.get(attrs.type, f"type {attrs.type}")


def get_peer_mem_addr(ptr_or_tensor) -> int:
    """The address a GPUDirect NIC registers: the device (or registered host) address
    itself, once cudaPointerGetAttributes confirms CUDA knows the memory."""
    ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
    kind = _memory_type(ref.address)
    if kind not in ("device", "host", "managed"):
        raise InvalidArgumentError(
            f"memory at {ref.address:#x} is {kind} for CUDA: a NIC can register device memory "
            f"or cudaHostAlloc/registered host memory only")
    return ref.address


def set_data_ipc(tensor, name: str) -> None:
    """Share CUDA device memory under `name` through a CUDA IPC handle (plus the tensor's
    offset inside its allocation, since a handle names the whole allocation)."""
    ref = memory_ref(tensor, "tensor")
    if ref.nbytes is None:
        raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
    rt = _runtime
    kind = _memory_type(ref.address)
    if kind != "device":
        raise InvalidArgumentError(f"set_data_ipc needs CUDA device memory; {ref.address:#x} is "
                                   f"{kind}")
    base, size = rt.address_range(ref.address)
    handle = rt.ffi.new("cudaIpcMemHandle_t *")
    rt.check(rt.lib.cudaIpcGetMemHandle(handle, rt.pointer(ref.address)), "cudaIpcGetMemHandle")
    publish_shared(name, {"handle": bytes(rt.ffi.buffer(handle)).hex(), "nbytes": ref.nbytes,
                          "offset": ref.address - base})


_opened: dict[str, int] = {}  # handle -> mapped base; CUDA refuses to open a handle twice


def share_external_data(like, name: str, shape, timeout: float | None = 60.0):
    """Map the CUDA memory shared as `name` (at its offset); a SharedDeviceBuffer of
    `like`'s dtype and `shape`."""
    record, shape, dtype, need = request_shared(like, name, shape, timeout)
    rt = _runtime
    base = _opened.get(record["handle"])
    if base is None:
        handle = rt.ffi.new("cudaIpcMemHandle_t *")
        rt.ffi.buffer(handle)[:] = bytes.fromhex(record["handle"])
        ptr = rt.ffi.new("void **")
        rt.check(rt.lib.cudaIpcOpenMemHandle(ptr, handle[0],
                                             CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
        base = _opened[record["handle"]] = rt.address(ptr[0])
    return SharedDeviceBuffer(base + record["offset"], shape, dtype, need)


class CudaBackend(Backend):
    name = "cuda"
    priority = 100

    def availability(self) -> Availability:
        global _runtime
        if _runtime is None or _runtime.path != find_library()[0]:
            _runtime = None
            try:
                _runtime = CudaRuntime()
            except OSError as e:
                return Availability(False, f"CUDA runtime not loadable: {e}")
        count, rc = _runtime.device_count()
        if rc != 0:
            return Availability(False, f"no usable GPU: cudaGetDeviceCount returned "
                                       f"{_runtime.error_text(rc)} ({_runtime.path})")
        if count == 0:
            return Availability(False, f"no GPU device ({_runtime.path})")
        return Availability(True, f"{count} GPU(s)")

    def platform(self) -> Platform:
        return CudaPlatform()


    def info(self) -> dict[str, object]:
        return {} if _runtime is None else _runtime.describe()

    def test_support(self):
        from pdhal_cuda.testing import CudaTestSupport

        return CudaTestSupport(_runtime.path)
