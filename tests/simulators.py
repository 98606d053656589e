"""The simulated runtimes of the cuda and xpu backends (no GPU or XPU here), by the names
the core's tests use: SimRuntime("xpu") is pdhal.testing.simulated's handle on pdhal-xpu's
simulated libxpurt.so, build("libxpurt_old.so") the path of a library either simulator
builds."""

from __future__ import annotations

from pdhal_cuda.testing import CudaTestSupport
from pdhal_xpu.testing import XpuTestSupport

from pdhal.testing import DeviceTensor
from pdhal.testing.simulated import SimulatedRuntime

SUPPORT = {"cuda": CudaTestSupport, "xpu": XpuTestSupport}
__all__ = ["DeviceTensor", "SimRuntime", "build"]


def SimRuntime(kind: str, library: str | None = None) -> SimulatedRuntime:  # noqa: N802
    """The simulated runtime of backend `kind` ("cuda", "xpu"), library by name."""
    return SimulatedRuntime(SUPPORT[kind], library)


def build(library: str) -> str:
    """Path of the simulated runtime `library`, from whichever backend's simulator builds it."""
    for support in SUPPORT.values():
        if library in support.simulator_libraries:
            return support.simulator(library)
    raise KeyError(f"no simulator builds {library}")
