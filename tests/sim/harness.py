"""Test-side handles on the simulated runtimes (the same loaded library the backend uses)."""

from __future__ import annotations

from cffi import FFI

from pdhal.testing import DeviceTensor  # noqa: F401  (re-exported for the sim tests)
from sim.build import build

# Per runtime: how to allocate device memory and streams, and the test-only kernel.
PREFIX = {"xpu": ("xpu_malloc", "xpu_stream_create", "sim_xpu_launch_write"),
          "cuda": ("cudaMalloc", "cudaStreamCreate", "sim_cuda_launch_write")}

CDEF = """
int {malloc}(void **ptr, uint64_t size{extra});
int {stream}(void **s);
int {launch}(void *s, void *dst, const void *src, uint64_t n, uint32_t delay_us);
int sim_live_events(void);
int sim_live_streams(void);
int sim_live_host_buffers(void);
"""


class SimRuntime:
    """Device memory, streams and the delayed-write kernel of a simulated runtime."""

    def __init__(self, kind: str, library: str):
        self.kind = kind
        self.path = build(library)
        malloc, stream, launch = PREFIX[kind]
        self.ffi = FFI()
        self.ffi.cdef(CDEF.format(malloc=malloc, stream=stream, launch=launch,
                                  extra=", int kind" if kind == "xpu" else ""))
        self.lib = self.ffi.dlopen(self.path)
        self._malloc = getattr(self.lib, malloc)
        self._stream = getattr(self.lib, stream)
        self._launch = getattr(self.lib, launch)

    def malloc(self, n: int) -> int:
        p = self.ffi.new("void **")
        rc = self._malloc(p, n, 0) if self.kind == "xpu" else self._malloc(p, n)
        assert rc == 0
        return int(self.ffi.cast("uintptr_t", p[0]))

    def stream(self) -> int:
        s = self.ffi.new("void **")
        assert self._stream(s) == 0
        return int(self.ffi.cast("uintptr_t", s[0]))

    def launch_write(self, stream: int, dst: int, data: bytes, delay_us: int) -> None:
        """Queue a kernel on `stream` that sleeps delay_us, then writes `data` at dst."""
        assert self._launch(self.ffi.cast("void *", stream), self.ffi.cast("void *", dst), data,
                            len(data), delay_us) == 0
