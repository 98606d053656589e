"""Simulated vendor runtimes, for backends tested where their hardware is not: a pretend
device (sim/sim_device.c: streams as threads, events, device memory in shared memory,
failure injection) that a backend's simulator (its runtime's C ABI over that device, shipped
beside the backend's testing module) is compiled with; a TestSupport over such a runtime;
and a test-side handle on one (its live-object counters, its failure injection).

A runtime without the test-only delayed-write kernel (real hardware) cannot lend the kit
"work that writes after a delay" this way; a backend proving itself on hardware supplies its
own TestSupport."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import ClassVar

from cffi import FFI

from pdhal._backends.test_support import DeviceTensor, TestSupport
from pdhal._errors import UnsupportedError

#: The pretend device every simulator is compiled with.
DEVICE_SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sim")


def build_simulator(name: str, sources: list[str], flags: tuple[str, ...] = ()) -> str:
    """Path of the shared library `name` compiled from `sources` (C files of a runtime's
    ABI) and the pretend device, rebuilt when missing or older than a source. It goes to a
    build/ folder beside the first source (a temporary folder if that is read-only); under
    PDHAL_SANITIZE=1 (make sanitize) to a folder of its own, with ASan/UBSan, so the
    simulator's own memory errors are caught with pdhal's."""
    folder = os.path.join(os.path.dirname(sources[0]), "build")
    if not os.access(os.path.dirname(folder), os.W_OK):
        folder = os.path.join(tempfile.gettempdir(), f"pdhal-sim-{os.geteuid()}")
    if os.environ.get("PDHAL_SANITIZE") == "1":
        folder = os.path.join(folder, "sanitize")
        flags = (*flags, "-fsanitize=address,undefined", "-fno-omit-frame-pointer")
    out = os.path.join(folder, name)
    device = [os.path.join(DEVICE_SOURCES, f) for f in ("sim_device.c", "sim_device.h")]
    inputs = [*sources, *device]
    if not os.path.exists(out) or os.path.getmtime(out) < max(map(os.path.getmtime, inputs)):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        subprocess.run(
            ["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter"]
            + ["-shared", "-fPIC", f"-I{DEVICE_SOURCES}", *flags, "-o", tmp, device[0]]
            + [*sources, "-lpthread", "-lrt"],
            check=True,
        )
        os.replace(tmp, out)
    return out


class SimulatedRuntimeSupport(TestSupport):
    """Subclasses name the runtime's functions: malloc(void **, size[, kind]), free(void *),
    stream_create(void **), and the kernel (stream, dst, src, n, delay_us); and the
    simulator: its C sources (beside the subclass's module) and, per library it builds,
    the compiler flags (the first is the default)."""

    malloc = free = stream_create = kernel = ""
    malloc_kind_argument = False
    asynchronous = True  # the kernel runs on the simulated stream's thread
    simulator_sources: ClassVar[tuple[str, ...]] = ()
    simulator_libraries: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def simulator(cls, name: str | None = None) -> str:
        """Path of the simulated runtime `name` (default: the first of simulator_libraries),
        built if need be."""
        name = name or next(iter(cls.simulator_libraries))
        here = os.path.dirname(os.path.abspath(sys.modules[cls.__module__].__file__))
        sources = [os.path.join(here, source) for source in cls.simulator_sources]
        return build_simulator(name, sources, cls.simulator_libraries[name])

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


COUNTERS = """
int sim_live_events(void);
int sim_live_streams(void);
int sim_live_host_buffers(void);
int sim_fail(const char *function, int count);
void sim_fail_clear(void);
int sim_failed_calls(const char *function);
"""


class SimulatedRuntime:
    """A test's handle on a simulated runtime: the backend's TestSupport over it (`device`:
    device memory, streams, the delayed-write kernel) and, in `lib`, the pretend device's
    counters of live events, streams and host buffers. The process shares one copy of the
    runtime with the backend, so `fail` reaches the backend's calls too."""

    def __init__(self, support: type[SimulatedRuntimeSupport], library: str | None = None):
        self.path = support.simulator(library)
        self.device = support(self.path)
        ffi = FFI()
        ffi.cdef(COUNTERS)
        self.lib = ffi.dlopen(self.path)

    def malloc(self, n: int) -> int:
        return self.device.alloc(n).address

    def stream(self) -> int:
        return self.device.new_stream()

    def launch_write(self, stream: int, dst: int, data: bytes, delay_us: int) -> None:
        """Queue a kernel on `stream` that sleeps delay_us, then writes `data` at dst."""
        self.device.delayed_write(stream, dst, data, delay_us)

    def fail(self, function: str, count: int = -1) -> None:
        """Make the next `count` calls of the runtime's `function` fail with its error code
        (-1: every call, 0: stop). Child processes: SIM_FAIL="name[:count],..." instead."""
        assert self.lib.sim_fail(function.encode(), count) == 0, f"cannot inject into {function}"

    def failed_calls(self, function: str) -> int:
        """How many calls of `function` were made to fail so far."""
        return self.lib.sim_failed_calls(function.encode())

    def clear_failures(self) -> None:
        """Stop every injected failure and reset the counts (a test's teardown)."""
        self.lib.sim_fail_clear()
