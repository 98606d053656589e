"""TestSupport over a simulated vendor runtime (pdhal's tests/sim): device memory and
streams through the runtime, and its test-only delayed-write kernel.

A runtime without that kernel (real hardware) cannot lend the kit "work that writes after a
delay" this way; a backend proving itself on hardware supplies its own TestSupport."""

from __future__ import annotations

from cffi import FFI

from pdhal._backends.test_support import DeviceTensor, TestSupport
from pdhal._errors import UnsupportedError


class SimulatedRuntimeSupport(TestSupport):
    """Subclasses name the runtime's functions: malloc(void **, size[, kind]), free(void *),
    stream_create(void **), and the kernel (stream, dst, src, n, delay_us)."""

    malloc = free = stream_create = kernel = ""
    malloc_kind_argument = False
    asynchronous = True  # the kernel runs on the simulated stream's thread

    def __init__(self, library_path: str):
        self.ffi = FFI()
        extra = ", int kind" if self.malloc_kind_argument else ""
        self.ffi.cdef(f"""
            int {self.malloc}(void **ptr, uint64_t size{extra});
            int {self.free}(void *ptr);
            int {self.stream_create}(void **stream);
            int {self.kernel}(void *stream, void *dst, const void *src, uint64_t n,
                              uint32_t delay_us);""")
        self.lib = self.ffi.dlopen(library_path)
        self.library_path = library_path
        self._allocations: list[int] = []
        self._stream = None

    def alloc(self, nbytes: int) -> DeviceTensor:
        ptr = self.ffi.new("void **")
        args = (ptr, nbytes, 0) if self.malloc_kind_argument else (ptr, nbytes)
        assert getattr(self.lib, self.malloc)(*args) == 0, f"{self.malloc}({nbytes}) failed"
        address = int(self.ffi.cast("uintptr_t", ptr[0]))
        self._allocations.append(address)
        return DeviceTensor(address, nbytes, self.device)

    def stream(self):
        if self._stream is None:
            self._stream = self.new_stream()
        return self._stream

    def new_stream(self) -> int:
        """A stream of its own (stream() hands out one shared stream)."""
        s = self.ffi.new("void **")
        assert getattr(self.lib, self.stream_create)(s) == 0
        return int(self.ffi.cast("uintptr_t", s[0]))

    def delayed_write(self, stream, address: int, data: bytes, delay_us: int) -> None:
        try:
            kernel = getattr(self.lib, self.kernel)
        except AttributeError:
            raise UnsupportedError(
                f"{self.library_path} has no test kernel {self.kernel}: the "
                f"kit's ordering checks need a simulated runtime or a "
                f"backend TestSupport of its own"
            ) from None
        rc = kernel(
            self.ffi.cast("void *", stream or 0),
            self.ffi.cast("void *", address),
            data,
            len(data),
            delay_us,
        )
        assert rc == 0, f"{self.kernel} failed with {rc}"

    def release(self) -> None:
        while self._allocations:
            getattr(self.lib, self.free)(self.ffi.cast("void *", self._allocations.pop()))
