"""Test-side handle on a simulated runtime: the backend's own TestSupport for it (device
memory, streams, the delayed-write kernel) plus the simulator's live-object counters and its
failure injection."""

from __future__ import annotations

from cffi import FFI
from pdhal_cuda.testing import CudaTestSupport
from pdhal_xpu.testing import XpuTestSupport
from sim.build import build

from pdhal.testing import DeviceTensor  # noqa: F401  (re-exported for the sim tests)

SUPPORT = {"cuda": CudaTestSupport, "xpu": XpuTestSupport}

COUNTERS = """
int sim_live_events(void);
int sim_live_streams(void);
int sim_live_host_buffers(void);
int sim_fail(const char *function, int count);
void sim_fail_clear(void);
int sim_failed_calls(const char *function);
"""


class SimRuntime:
    """Device memory, streams and the delayed-write kernel of a simulated runtime; `lib`
    has its counters of live events, streams and host buffers. The process shares one copy
    of the runtime with the backend, so `fail` reaches the backend's calls too."""

    def __init__(self, kind: str, library: str):
        self.path = build(library)
        self.device = SUPPORT[kind](self.path)
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
