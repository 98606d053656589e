"""TestSupport of the xpu backend for pdhal's conformance kit (simulated runtime).

`python -m pdhal_xpu.testing [LIBRARY]` builds the simulated runtime and prints its path."""

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
    #: The simulated runtime (the runtime's C ABI over pdhal.testing's pretend device).
    simulator_sources = ("sim/xpurt_sim.c",)
    simulator_libraries = {"libxpurt.so": (), "libxpurt_old.so": ("-DSIM_OLD_RUNTIME",)}


if __name__ == "__main__":
    import sys

    print(XpuTestSupport.simulator(*sys.argv[1:]))
