"""TestSupport of the cuda backend for pdhal's conformance kit (simulated runtime)."""

from pdhal.testing.simulated import SimulatedRuntimeSupport


class CudaTestSupport(SimulatedRuntimeSupport):
    device = "gpu:0"
    malloc, free, stream_create, kernel = (
        "cudaMalloc",
        "cudaFree",
        "cudaStreamCreate",
        "sim_cuda_launch_write",
    )
