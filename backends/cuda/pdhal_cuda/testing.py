"""TestSupport of the cuda backend for pdhal's conformance kit (simulated runtime).

`python -m pdhal_cuda.testing [LIBRARY]` builds the simulated runtime and prints its path."""

from pdhal.testing.simulated import SimulatedRuntimeSupport


class CudaTestSupport(SimulatedRuntimeSupport):
    device = "gpu:0"
    malloc, free, stream_create, kernel = (
        "cudaMalloc",
        "cudaFree",
        "cudaStreamCreate",
        "sim_cuda_launch_write",
    )
    #: The simulated runtime (the runtime's C ABI over pdhal.testing's pretend device).
    simulator_sources = ("sim/cudart_sim.c",)
    simulator_libraries = {"libcudart_sim.so": ()}


if __name__ == "__main__":
    import sys

    print(CudaTestSupport.simulator(*sys.argv[1:]))
