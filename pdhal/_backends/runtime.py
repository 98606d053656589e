"""RuntimeBackend: the shapes every accelerator backend shares, parameterised by the names
of its runtime's functions, so that a backend is mostly calls into its runtime.

A backend over a vendor runtime (CUDA, XPU, ...) subclasses it, names the runtime's symbols
as class attributes, and writes only what really differs: how a layer signal follows the
stream when no sender is given, the peer address, the device count, which memory an IPC
handle names, the copy kind. It gets every op of the op table: the runtime bound in
availability() and held on the instance, stream handles parsed, pinned host memory freed by
the runtime that allocated it (after the copies queued on it), layer signals posted behind a
device event to a sender thread, the sender itself, and IPC sharing with each handle opened
once per process and closed with its last import.
"""

from __future__ import annotations

import threading
from typing import ClassVar

from pdhal._backends.contract import Availability, Backend
from pdhal._backends.optable import BACKEND_OPS
from pdhal._backends.runtime_library import RuntimeLibrary
from pdhal._errors import DeviceError, InvalidArgumentError, InvalidTypeError, UnsupportedError
from pdhal._inputs.tensors import MemoryRef, memory_ref
from pdhal._memory import blocks as _blocks
from pdhal._memory import extents as _extents
from pdhal._memory import published as _published
from pdhal._memory import sharedhost as _sharedhost
from pdhal._memory.hostmem import HostBuffer
from pdhal._memory.sharedhost import SharedHostBuffer
from pdhal._protocol.names import validate_index
from pdhal._protocol.sender import KVSignalSender, require_signal
from pdhal._protocol.signals import KernelSignal, LayerSignal


class _Fence:
    """A device event marking where the copies queued on one stream end (RuntimeBackend.fence)."""

    __slots__ = ("event", "waiters")

    def __init__(self, event):
        self.event = event
        self.waiters = 0  # threads in wait_queued on it: it is not destroyed under them


class RuntimeSharedHostBuffer(SharedHostBuffer):
    """Host memory in a pdhal shared segment (so set_data_ipc shares it with any process,
    whatever runtime that one binds), pinned by registering it with this runtime, and
    unregistered once the copies queued on it have run."""

    def __init__(self, backend: RuntimeBackend, nbytes: int):
        self._runtime = backend.runtime
        self._backend = backend
        super().__init__(nbytes)

    def _pin(self, address: int, nbytes: int) -> bool:
        rt, register = self._runtime, self._backend.host_register_symbol
        rt.check(
            getattr(rt.lib, register)(rt.pointer(address), nbytes, 0),
            f"{register}({nbytes} bytes of host_alloc)",
        )
        return True

    def _unpin(self, queued_on: set) -> None:
        self._backend.wait_queued(queued_on)
        rt, unregister = self._runtime, self._backend.host_unregister_symbol
        rt.check(getattr(rt.lib, unregister)(rt.pointer(self._address)), unregister)


class RuntimeHostBuffer(HostBuffer):
    """Pinned host memory from a runtime's allocator (where the runtime cannot register
    host memory: private to this process), returned to that same runtime once the copies
    queued on it have run."""

    def __init__(self, backend: RuntimeBackend, address: int, nbytes: int):
        super().__init__(address, nbytes, pinned=True)
        self._runtime = backend.runtime
        self._backend = backend

    def _release(self, queued_on: set) -> None:
        self._backend.wait_queued(queued_on)
        rt, free = self._runtime, self._backend.host_free_symbol
        rt.check(getattr(rt.lib, free)(rt.pointer(self._address)), free)


class RuntimeBackend(Backend):
    """A Backend over a RuntimeLibrary. Subclasses set the class attributes below and
    implement device_count_now(), platform(), signal_without_sender(), get_peer_mem_addr()
    and copy_kind() (and ipc_base() where a handle names more than the tensor); every other
    op of the op table is ready-made here."""

    #: The RuntimeLibrary subclass to bind; its find_library() says where from.
    runtime_class: ClassVar[type[RuntimeLibrary]]
    #: Pinned host memory: alloc(void **ptr, size, unsigned flags) and free(void *ptr).
    host_alloc_symbol: ClassVar[str] = ""
    host_free_symbol: ClassVar[str] = ""
    #: Device events: create(event *, *event_create_args), record(event, stream),
    #: wait(event), destroy(event).
    event_create_symbol: ClassVar[str] = ""
    event_create_args: ClassVar[tuple] = ()
    event_record_symbol: ClassVar[str] = ""
    event_wait_symbol: ClassVar[str] = ""
    event_destroy_symbol: ClassVar[str] = ""
    #: Optional non-blocking query(event): 0 once fired. With it the sender polls queued
    #: events instead of sleeping in the blocking wait (see KVSignalSender).
    event_query_symbol: ClassVar[str] = ""
    #: Host registration (the memory a NIC registers is pinned by the runtime):
    #: register(void *ptr, size, unsigned flags) and unregister(void *ptr).
    host_register_symbol: ClassVar[str] = ""
    host_unregister_symbol: ClassVar[str] = ""
    #: Asynchronous copy (dst, src, bytes, kind, stream), as cudaMemcpyAsync, and the wait
    #: for a stream's work, sync(stream).
    copy_symbol: ClassVar[str] = ""
    stream_sync_symbol: ClassVar[str] = ""
    #: Attributes under which framework stream objects expose their raw handle.
    stream_attributes: ClassVar[tuple[str, ...]] = ()
    #: Words for the device in messages ("GPU", "XPU device").
    device_word: ClassVar[str] = "device"
    #: IPC: the handle's C type, get(handle *, void *ptr), open(void **ptr, handle, flags)
    #: with ipc_open_flags, and close(void *ptr) (optional: a runtime without it keeps its
    #: mappings).
    ipc_handle_type: ClassVar[str] = ""
    ipc_get_symbol: ClassVar[str] = ""
    ipc_open_symbol: ClassVar[str] = ""
    ipc_open_flags: ClassVar[int] = 0
    ipc_close_symbol: ClassVar[str] = ""

    def __init__(self):
        #: The bound runtime, None until availability() found one.
        self.runtime: RuntimeLibrary | None = None
        #: (device, stream handle) -> the fence after the last copy there that used pdhal's
        #: memory: what a free of that memory waits for (the stream itself may be gone).
        self._fences: dict[tuple[int, int], _Fence] = {}
        self._fences_lock = threading.Lock()
        self._opened: dict[str, int] = {}  # IPC handle -> mapped base: opened once
        self._imports: dict[str, tuple[str, object]] = {}  # name -> (IPC handle, its extent)
        self._ipc_lock = threading.Lock()

    # ---- binding -------------------------------------------------------------------

    def bind_runtime(self) -> str | None:
        """Bind the runtime where runtime_class.find_library() points now (again, if that
        changed since); None once bound, else why it cannot be loaded."""
        path = self.runtime_class.find_library()[0]
        if self.runtime is None or self.runtime.path != path:
            self.runtime = None
            try:
                self.runtime = self.runtime_class()
            except OSError as e:
                return self.runtime_class.not_loadable(e)
        return None

    def device_count_now(self) -> tuple[int, str]:
        """(devices, "" or why none can be counted), from the bound runtime."""
        raise NotImplementedError

    def availability(self) -> Availability:
        why = self.bind_runtime()
        if why is not None:
            return Availability(False, why)
        count, why = self.device_count_now()
        if why:
            return Availability(False, why)
        if count == 0:
            return Availability(False, f"no {self.device_word} ({self.runtime.path})")
        return Availability(True, f"{count} {self.device_word}(s)")

    def info(self) -> dict[str, object]:
        return {} if self.runtime is None else self.runtime.describe()

    def ops(self) -> dict:
        """Every backend op of the op table, as this backend's methods of the same name
        (get_peer_mem_addr through peer_address)."""
        table = {name: getattr(self, name) for name in BACKEND_OPS}
        table["get_peer_mem_addr"] = self.peer_address
        return table

    def peer_address(self, ptr_or_tensor) -> int:
        """What get_peer_mem_addr gives: a host_alloc buffer's own address (pinned host
        memory, which a NIC registers as it is, on every device: a staged cache's mirror),
        else the device's answer (the subclass's get_peer_mem_addr)."""
        ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
        if ref.device == "cpu" and ref.extent is not None:
            return ref.address
        return self.get_peer_mem_addr(ptr_or_tensor)

    # ---- streams -------------------------------------------------------------------

    def framework_stream(self) -> object | None:
        """The current stream of a framework already imported (Paddle built for this
        device), or None for the runtime's default stream. Override per device."""
        return None

    def stream_handle(self, stream) -> int:
        """The raw stream handle of `stream`: an int, an object exposing one of
        stream_attributes, or None (the framework's current stream, else the default 0)."""
        if stream is None:
            stream = self.framework_stream()
            if stream is None:
                return 0
        if isinstance(stream, int) and not isinstance(stream, bool):
            if stream < 0:
                raise InvalidArgumentError(f"stream handle must be >= 0, got {stream}")
            return stream
        for attribute in self.stream_attributes:
            if hasattr(stream, attribute):
                return int(getattr(stream, attribute))
        raise InvalidTypeError(
            f"stream must be an int {self.name} stream handle or expose "
            f"{' / '.join(self.stream_attributes)}, got {type(stream).__name__}"
        )

    # ---- host memory ---------------------------------------------------------------

    def host_alloc(self, nbytes: int) -> RuntimeSharedHostBuffer | RuntimeHostBuffer:
        """Pinned host memory: a shared segment registered with the runtime (shareable by
        set_data_ipc), or, where the runtime cannot register host memory, from its host
        allocator."""
        nbytes = validate_index(nbytes, "nbytes", 1 << 46)
        if nbytes == 0:
            raise InvalidArgumentError("nbytes must be at least 1")
        rt = self.runtime
        if rt.has(self.host_register_symbol):
            return RuntimeSharedHostBuffer(self, nbytes)
        ptr = rt.ffi.new("void **")
        rt.check(
            getattr(rt.lib, self.host_alloc_symbol)(ptr, nbytes, 0),
            f"{self.host_alloc_symbol}({nbytes})",
        )
        return RuntimeHostBuffer(self, rt.address(ptr[0]), nbytes)

    def host_free(self, buf: HostBuffer) -> None:
        """Free memory from host_alloc, through the runtime that allocated it."""
        if (
            not isinstance(buf, (RuntimeSharedHostBuffer, RuntimeHostBuffer))
            or buf._runtime is not self.runtime
        ):
            raise InvalidTypeError(
                f"host_free needs a buffer from the {self.name} backend's "
                f"host_alloc, got {type(buf).__name__}"
            )
        buf.close()

    def host_register(self, ptr_or_tensor, nbytes: int | None = None) -> None:
        """Pin existing host memory through the runtime (what a NIC registers must be)."""
        ref = memory_ref(ptr_or_tensor, "ptr_or_tensor")
        size = ref.nbytes if nbytes is None else validate_index(nbytes, "nbytes", 1 << 46)
        if not size:
            raise InvalidArgumentError("host_register needs nbytes with a raw address")
        rt = self.runtime
        register = rt.optional(self.host_register_symbol)
        rt.check(
            register(rt.pointer(ref.address), size, 0),
            f"{self.host_register_symbol}({ref.address:#x}, {size})",
        )
        _extents.register(ref.address, size, "cpu", "host_register")

    def host_unregister(self, ptr_or_tensor) -> None:
        """Undo host_register of the same address."""
        address = memory_ref(ptr_or_tensor, "ptr_or_tensor").address
        extent = _extents.find(address)
        if extent is None or extent.start != address or extent.what != "host_register":
            raise InvalidArgumentError(f"{address:#x} was not registered with host_register")
        self.wait_queued(_extents.retire(extent))  # no copy may run on memory the NIC let go
        rt = self.runtime
        rt.check(
            rt.optional(self.host_unregister_symbol)(rt.pointer(address)),
            self.host_unregister_symbol,
        )

    # ---- block copies --------------------------------------------------------------

    def copy_kind(self, dst_device: str, src_device: str) -> int:
        """The runtime's copy kind for a copy from `src_device` memory to `dst_device`."""
        raise NotImplementedError

    def copy_blocks(
        self, dst, dst_block_ids, src, src_block_ids, block_bytes: int, stream=None
    ) -> int:
        """Copy block src_block_ids[i] of `src` into block dst_block_ids[i] of `dst`,
        ordered on `stream` after the work queued there (runs of consecutive ids as one
        copy; every id checked first); `dst` and `src` may be lists of layers, the same ids
        copied in each. Returns the copies issued; synchronize(stream) waits for them."""
        rt = self.runtime
        return _blocks.copy_blocks(
            rt.address(getattr(rt.lib, self.copy_symbol)),
            self.copy_kind,
            self.stream_handle(stream),
            dst,
            dst_block_ids,
            src,
            src_block_ids,
            block_bytes,
            self.fence,
        )

    def fence(self, stream: int, held: list) -> None:
        """Mark `held` (the extents a copy just used) as having work queued on `stream`,
        and record the stream's fence behind it: what a free of that memory waits for. A
        fence is one event per (device, stream), re-recorded by every copy. If the runtime
        refuses the event, wait for the stream instead: a free must never outrun a copy."""
        rt = self.runtime
        key = (self.current_device(), stream)  # an event records on its own device's streams
        with self._fences_lock:  # with the destroy in wait_queued: never a mark without fence
            _extents.mark_queued(held, key)
            fence = self._fences.get(key)
            if fence is None:
                try:
                    fence = self._fences[key] = _Fence(self.new_event())
                except DeviceError:
                    pass  # no event to spare: the stream is waited for below
            if fence is not None:
                if getattr(rt.lib, self.event_record_symbol)(fence.event, rt.pointer(stream)) == 0:
                    return
        self.synchronize(stream)

    def wait_queued(self, keys: set) -> None:
        """Wait until the copies queued under `keys` (what retire returned) have run: what
        a free, an unregister or an unmap of memory those copies used waits for. The wait
        holds no lock (other threads' copies go on); a fence no live memory needs any more
        is destroyed once nobody waits on it."""
        rt = self.runtime
        for key in keys:
            with self._fences_lock:
                fence = self._fences.get(key)
                if fence is None:
                    continue
                fence.waiters += 1
            try:
                rt.check(
                    getattr(rt.lib, self.event_wait_symbol)(fence.event), self.event_wait_symbol
                )
            finally:
                with self._fences_lock:
                    fence.waiters -= 1
        if keys:
            with self._fences_lock:
                for key in keys - _extents.streams_in_use():
                    fence = self._fences.get(key)
                    if fence is not None and not fence.waiters:
                        del self._fences[key]
                        getattr(rt.lib, self.event_destroy_symbol)(fence.event)

    def synchronize(self, stream=None) -> None:
        """Wait until the work queued on `stream` so far has finished."""
        rt = self.runtime
        rt.check(
            getattr(rt.lib, self.stream_sync_symbol)(rt.pointer(self.stream_handle(stream))),
            self.stream_sync_symbol,
        )

    # ---- shared buffers ------------------------------------------------------------

    #: This runtime's devices in MemoryRef terms ("gpu" for CUDA, "xpu").
    device_kind: ClassVar[str] = ""

    def current_device(self) -> int:
        """The device this thread uses now (override: the runtime's get-device call)."""
        return 0

    def ipc_base(self, ref: MemoryRef) -> int:
        """The start of the memory an IPC handle of `ref` names (its whole allocation, on
        runtimes like CUDA's); refuses memory the runtime cannot share. Default: `ref`."""
        return ref.address

    def ipc_size(self, base: int) -> int | None:
        """The bytes of the allocation an IPC handle opened at `base` (where a record's
        offset and size must lie: it is another process's word); None where the runtime
        cannot say."""
        return None

    def set_data_ipc(self, tensor, name: str) -> None:
        """Share memory under `name`: host memory from host_alloc as its shared segment
        (any process maps it, whatever its runtime); device memory as this runtime's IPC
        handle, plus the tensor's offset inside what the handle names."""
        ref = memory_ref(tensor, "tensor")
        if ref.nbytes is None:
            raise InvalidTypeError("set_data_ipc needs a tensor or array, not a raw address")
        if ref.device == "cpu" or _sharedhost.owning(ref.address, ref.nbytes) is not None:
            if not self.runtime.has(self.host_register_symbol):
                raise UnsupportedError(
                    f"the {self.name} runtime here has no {self.host_register_symbol}, so its "
                    f"host_alloc memory is its own process's: set_data_ipc shares device "
                    f"memory only ({ref.address:#x} is host memory)"
                )
            _sharedhost.publish(ref, name, self.name)
            return
        base = self.ipc_base(ref)
        rt = self.runtime
        handle = rt.ffi.new(f"{self.ipc_handle_type} *")
        get_handle = rt.optional(self.ipc_get_symbol)
        rt.check(get_handle(handle, rt.pointer(ref.address)), self.ipc_get_symbol)
        handle_hex = bytes(rt.ffi.buffer(handle)).hex()
        _published.publish(
            name,
            {
                "handle": handle_hex,
                "backend": self.name,  # whose runtime alone can open the handle
                "nbytes": ref.nbytes,
                "offset": ref.address - base,
            },
        )

    def share_external_data(self, like, name: str, shape, timeout: float | None = 60.0):
        """Map the memory shared as `name`: host memory as an array (or a Paddle tensor
        when `like` is one) over its segment; device memory as a SharedDeviceBuffer of
        `like`'s dtype and `shape`, on this thread's device (each handle opened once per
        process)."""
        record, shape, dtype, need = _published.request(like, name, shape, timeout)
        if _sharedhost.is_host_record(record):
            return _sharedhost.import_shared(like, name, record, shape, dtype, need)
        if record.get("backend") != self.name:
            raise UnsupportedError(
                f"{name!r} is device memory shared by the {record.get('backend')} backend's "
                f"runtime (its IPC handle), which this process's {self.name} runtime cannot "
                f"open: share host memory from host_alloc between backends"
            )
        rt = self.runtime
        with self._ipc_lock:  # an unset of the handle's last import must not close it meanwhile
            base = self._opened.get(record["handle"])
            if base is None:
                handle = rt.ffi.new(f"{self.ipc_handle_type} *")
                try:
                    words = bytes.fromhex(record["handle"])
                    rt.ffi.buffer(handle)[:] = words
                except ValueError:
                    raise InvalidArgumentError(
                        f"the record of {name!r} holds no {self.ipc_handle_type} (its handle is "
                        f"{record['handle'][:80]!r})"
                    ) from None
                ptr = rt.ffi.new("void **")
                open_handle = rt.optional(self.ipc_open_symbol)
                rt.check(open_handle(ptr, handle[0], self.ipc_open_flags), self.ipc_open_symbol)
                base = self._opened[record["handle"]] = rt.address(ptr[0])
            try:
                size = self.ipc_size(base)
                if size is not None and record["offset"] + need > size:
                    raise InvalidArgumentError(
                        f"the record of {name!r} names bytes [{record['offset']}, +{need}) of "
                        f"an allocation of {size} bytes: not what set_data_ipc shares"
                    )
                buffer = self.mapped(base + record["offset"], shape, dtype, need, name)
            except BaseException:
                self._close_unused(record["handle"])  # opened for this import alone
                raise
            self._imports[name] = (record["handle"], buffer.extent)
        return buffer

    def unset_data_ipc(
        self, tensor, name: str, close_ipc: bool = True, unlink_shm: bool = True
    ) -> None:
        """Stop sharing `name`: with close_ipc, unmap this process's import of it (once the
        ops using it are done; the handle closes with its last import, where the runtime
        can); with unlink_shm, remove the record (this process's own; another live
        publisher's is refused)."""
        _published.unset(name, unlink_shm)  # first: a refusal leaves the mapping as it was
        if not close_ipc:
            return
        _sharedhost.forget(name, self.unmapping)  # its host memory, if that is what it was
        with self._ipc_lock:
            if name not in self._imports:
                return
            handle, extent = self._imports.pop(name)
            self.unmapping(extent)
            self._close_unused(handle)

    def _close_unused(self, handle: str) -> None:
        """Close an opened IPC handle once no import uses it (under _ipc_lock), where the
        runtime can."""
        if any(h == handle for h, _ in self._imports.values()):
            return
        base = self._opened.pop(handle)
        rt = self.runtime
        if rt.has(self.ipc_close_symbol):
            close = getattr(rt.lib, self.ipc_close_symbol)
            rt.check(close(rt.pointer(base)), self.ipc_close_symbol)

    def unmapping(self, mapping) -> None:
        """Before an IPC mapping goes (its extent, or the address it was mapped at): wait for
        the ops using it, queued copies included, and refuse new ones."""
        self.wait_queued(_extents.retire(mapping))

    def mapped(self, address: int, shape: tuple, dtype: str, nbytes: int, name: str):
        """The SharedDeviceBuffer share_external_data returns over `address`, on the
        device this thread uses (a cache process on device 3 maps onto device 3)."""
        return _published.mapped(
            address, shape, dtype, nbytes, f"{self.device_kind}:{self.current_device()}", name
        )

    # ---- layer signals behind device events ----------------------------------------

    def signal_layer_ready(self, signal, stream=None, sender=None) -> None:
        """Make the layer count as ready once the work queued on `stream` so far has
        finished: through `sender`'s thread, behind an event, or as the runtime does without
        one (signal_without_sender)."""
        signal = require_signal(signal)
        if signal.segment is None:
            return
        if sender is None:
            self.signal_without_sender(signal, stream)
        else:
            self.post_behind_event(signal, stream, self.require_sender(sender))

    def signal_without_sender(self, signal: LayerSignal | KernelSignal, stream) -> None:
        """signal_layer_ready's way when the engine passes no sender (a host function on
        the stream, or a process-wide sender)."""
        raise NotImplementedError

    def create_kv_signal_sender(self) -> KVSignalSender:
        """A long-lived sender thread that waits on this runtime's device events."""
        rt = self.runtime
        query = self.event_query_symbol if rt.has(self.event_query_symbol) else None
        return KVSignalSender(
            rt.address(getattr(rt.lib, self.event_wait_symbol)),
            rt.address(getattr(rt.lib, self.event_destroy_symbol)),
            backend=self.name,
            event_query=query and rt.address(getattr(rt.lib, query)),
        )

    def require_sender(self, sender: object) -> KVSignalSender:
        if not isinstance(sender, KVSignalSender) or sender.backend != self.name:
            raise InvalidArgumentError(
                f"sender must come from the {self.name} backend's "
                f"create_kv_signal_sender, got {sender!r}"
            )
        return sender

    def post_behind_event(
        self, signal: LayerSignal | KernelSignal, stream, sender: KVSignalSender
    ) -> None:
        """Record an event on `stream` now and hand (event, signal) to `sender`, whose
        thread stores the signal once the event fired: the layer counts as ready only after
        the work queued before this call."""
        rt = self.runtime
        handle = rt.pointer(self.stream_handle(stream))
        event = self.new_event()
        rc = getattr(rt.lib, self.event_record_symbol)(event, handle)
        if rc != 0:
            getattr(rt.lib, self.event_destroy_symbol)(event)
            rt.check(rc, self.event_record_symbol)
        sender.post(rt.address(event), signal)

    def new_event(self):
        """A new device event of the runtime (DeviceError if it refuses one)."""
        rt = self.runtime
        out = rt.ffi.new("void **")
        rt.check(
            getattr(rt.lib, self.event_create_symbol)(out, *self.event_create_args),
            self.event_create_symbol,
        )
        return out[0]
