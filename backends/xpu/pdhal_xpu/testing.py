"""TestSupport of the xpu backend for pdhal's conformance kit (simulated runtime)."""

from pdhal.testing.simulated import SimulatedRuntimeSupport


class XpuTestSupport(SimulatedRuntimeSupport):
    device = "xpu:0"
    malloc, free, stream_create, kernel = (
        "xpu_malloc",
        "xpu_free",
        "xpu_stream_create",
        "sim_xpu_launch_write",
    )
    malloc_kind_argument = True
