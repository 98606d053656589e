"""Finding and binding the XPU runtime (libxpurt.so) with cffi in ABI mode."""

from __future__ import annotations

import importlib.util
import os

from pdhal.plugin import RuntimeLibrary

CDEF = """
typedef void *XPUStream;
typedef void *XPUEvent;
typedef struct { char reserved[64]; } XPUIpcMemHandle;
struct cudaPointerAttributes { int type; int device; void *devicePointer; void *hostPointer; };
int xpu_device_count(int *count);
int xpu_current_device(int *devid);
int xpu_set_device(int devid);
int xpu_get_runtime_version(uint32_t *major, uint32_t *minor);
int xpu_malloc(void **ptr, uint64_t size, int kind);
int xpu_free(void *ptr);
int xpu_host_alloc(void **ptr, uint64_t size, unsigned int flags);
int xpu_host_free(void *ptr);
int xpu_event_create(XPUEvent *ev);
int xpu_event_record(XPUEvent ev, XPUStream stream);
int xpu_event_wait(XPUEvent ev);
int xpu_event_query(XPUEvent ev);
int xpu_event_destroy(XPUEvent ev);
int xpu_wait(XPUStream s);
int xpu_memcpy_async(void *dst, const void *src, uint64_t size, int kind, XPUStream stream);
int cudaHostRegister(void *ptr, size_t size, unsigned int flags);
int cudaHostUnregister(void *ptr);
int xpu_ipc_close_memhandle(void *devptr);
int xpu_ipc_get_memhandle(XPUIpcMemHandle *handle, void *devptr);
int xpu_ipc_open_memhandle(void **devptr, XPUIpcMemHandle handle, unsigned int flags);
int cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr);
"""


#: XPUMemcpyKind
XPU_DEVICE_TO_HOST, XPU_HOST_TO_DEVICE, XPU_DEVICE_TO_DEVICE = 0, 1, 2


class XpuRuntime(RuntimeLibrary):
    """libxpurt.so, bound where it was found."""

    cdef = CDEF
    title = "XPU runtime"
    path_variable = "PDHAL_XPURT"
    provided_by = "Paddle's XPU wheel (paddlepaddle-xpu, which ships paddle/libs/libxpurt.so)"

    @classmethod
    def find_library(cls) -> tuple[str, str]:
        """(path or soname, how it was found): PDHAL_XPURT, then Paddle's XPU wheel, then the
        system loader. Paddle is located without being imported."""
        explicit = os.environ.get("PDHAL_XPURT")
        if explicit:
            return explicit, "PDHAL_XPURT"
        spec = importlib.util.find_spec("paddle")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            candidate = os.path.join(folder, "libs", "libxpurt.so")
            if os.path.exists(candidate):
                return candidate, "paddle wheel"
        return "libxpurt.so", "system loader"

    def version(self) -> str:
        major, minor = self.ffi.new("uint32_t *"), self.ffi.new("uint32_t *")
        self.check(self.lib.xpu_get_runtime_version(major, minor), "xpu_get_runtime_version")
        return f"{major[0]}.{minor[0]}"

    def device_count(self) -> int:
        count = self.ffi.new("int *")
        self.check(self.lib.xpu_device_count(count), "xpu_device_count")
        return count[0]
