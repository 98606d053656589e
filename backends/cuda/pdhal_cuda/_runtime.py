"""Finding and binding the CUDA runtime (libcudart) with cffi in ABI mode."""

from __future__ import annotations

import glob
import importlib.util
import os

from pdhal.plugin import RuntimeLibrary

CDEF = """
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *);
typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
struct cudaPointerAttributes { int type; int device; void *devicePointer; void *hostPointer; };
const char *cudaGetErrorString(int error);
int cudaRuntimeGetVersion(int *version);
int cudaDriverGetVersion(int *version);
int cudaGetDeviceCount(int *count);
int cudaSetDevice(int device);
int cudaGetDevice(int *device);
int cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *data);
int cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
int cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
int cudaEventSynchronize(cudaEvent_t event);
int cudaEventQuery(cudaEvent_t event);
int cudaEventDestroy(cudaEvent_t event);
int cudaHostAlloc(void **ptr, size_t size, unsigned int flags);
int cudaFreeHost(void *ptr);
int cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr);
int cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *ptr);
int cudaIpcOpenMemHandle(void **ptr, cudaIpcMemHandle_t handle, unsigned int flags);
int cudaIpcCloseMemHandle(void *ptr);
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream);
int cudaStreamSynchronize(cudaStream_t stream);
int cudaHostRegister(void *ptr, size_t size, unsigned int flags);
int cudaHostUnregister(void *ptr);
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t ptr);
"""

CUDA_EVENT_DISABLE_TIMING = 2
CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CUDA_MEMCPY_DEFAULT = 4  # the direction follows from the pointers (unified addressing)
CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # no driver at all, or one older than the runtime
MEMORY_TYPES = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}


def _loadable(soname: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


class CudaRuntime(RuntimeLibrary):
    """libcudart, bound where it was found; the driver's cuMemGetAddressRange comes from
    libcuda (or from the runtime library itself where it exports it, as the simulator does)."""

    cdef = CDEF
    title = "CUDA runtime"
    path_variable = "PDHAL_CUDART"
    provided_by = "the nvidia-cuda-runtime wheel (pip install nvidia-cuda-runtime-cu12)"

    @classmethod
    def find_library(cls) -> tuple[str, str]:
        """(path or soname, how it was found): PDHAL_CUDART, then the nvidia-cuda-runtime wheel,
        then libcudart.so.13 / .12 through the system loader."""
        explicit = os.environ.get("PDHAL_CUDART")
        if explicit:
            return explicit, "PDHAL_CUDART"
        spec = importlib.util.find_spec("nvidia")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            found = sorted(glob.glob(os.path.join(folder, "cuda_runtime", "lib", "libcudart.so.*")))
            if found:
                return found[-1], "nvidia-cuda-runtime wheel"
        for soname in ("libcudart.so.13", "libcudart.so.12"):
            if _loadable(soname):
                return soname, "system loader"
        return "libcudart.so.12", "system loader"

    def __init__(self):
        super().__init__()
        self._driver = None

    def error_text(self, rc: int) -> str:
        return f"error {rc} ({self.ffi.string(self.lib.cudaGetErrorString(rc)).decode()})"

    def version(self) -> str:
        version = self.ffi.new("int *")
        self.check(self.lib.cudaRuntimeGetVersion(version), "cudaRuntimeGetVersion")
        return f"{version[0] // 1000}.{version[0] % 1000 // 10}"

    def driver_problem(self) -> str:
        """Why cudaGetDeviceCount said "driver insufficient": no driver, or an old one."""
        import ctypes

        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return (
                "no NVIDIA driver here (libcuda.so.1 is not installed), so the CUDA runtime "
                "sees no GPU"
            )
        driver, runtime = self.ffi.new("int *"), self.ffi.new("int *")
        self.lib.cudaDriverGetVersion(driver)
        self.lib.cudaRuntimeGetVersion(runtime)
        return (
            f"the NVIDIA driver supports CUDA {driver[0] // 1000}.{driver[0] % 1000 // 10}, "
            f"older than this runtime's {runtime[0] // 1000}.{runtime[0] % 1000 // 10} "
            f"({self.path}): update the driver, or set PDHAL_CUDART to a libcudart the "
            f"driver supports"
        )

    def device_count(self) -> tuple[int, int]:
        """(count, error code): error 35 means no (or too old a) driver."""
        count = self.ffi.new("int *")
        rc = self.lib.cudaGetDeviceCount(count)
        return (count[0] if rc == 0 else 0), rc

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the device allocation holding `ptr`."""
        get_range = self._driver_function("cuMemGetAddressRange_v2")
        base, size = self.ffi.new("uint64_t *"), self.ffi.new("size_t *")
        self.check(get_range(base, size, ptr), "cuMemGetAddressRange_v2")
        return base[0], size[0]

    def _driver_function(self, name: str):
        if self.has(name):
            return getattr(self.lib, name)
        if self._driver is None:
            self._driver = self.ffi.dlopen("libcuda.so.1")
        return getattr(self._driver, name)
