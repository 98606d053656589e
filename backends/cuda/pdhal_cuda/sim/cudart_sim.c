/* cudart_sim.c: a simulated CUDA runtime (libcudart) for tests on machines without a GPU.
 * It exports the functions pdhal-cuda binds, with CUDA's semantics where pdhal relies on
 * them: host functions run in stream order on the stream's thread; an IPC handle names the
 * whole allocation and opening it returns the allocation's base (a tensor inside a larger
 * block must add its offset); cudaPointerGetAttributes reports unregistered memory as type 0
 * with success. Also exports the driver's cuMemGetAddressRange_v2, which real systems take
 * from libcuda. SIM_CUDA_DEVICES (default 8) sets the device count; SIM_CUDA_NO_DRIVER makes
 * cudaGetDeviceCount fail with 35 like a machine without a driver.
 * Every cuda* entry point (and cuMemGetAddressRange_v2) can be told to fail, see sim_fail in
 * sim_device.h, with the error a real runtime gives there: out of memory for allocations,
 * a launch failure for waits (a kernel fault before the event), invalid values elsewhere. */
#define _GNU_SOURCE
#include "sim_device.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorMapBufferObjectFailed = 205,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
    cudaErrorLaunchFailure = 719,
};

typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *);
typedef struct {
    char reserved[64];
} cudaIpcMemHandle_t;
struct cudaPointerAttributes {
    int type; /* 0 unregistered, 1 host, 2 device, 3 managed */
    int device;
    void *devicePointer;
    void *hostPointer;
};

static _Thread_local int current_device;

/* SIM_CUDA_NO_DRIVER: no driver at all; SIM_CUDA_OLD_DRIVER: one older than the runtime.
 * Both make cudaGetDeviceCount fail with 35, as CUDA does; the driver version tells. */
static int no_driver(void)
{
    return getenv("SIM_CUDA_NO_DRIVER") != NULL || getenv("SIM_CUDA_OLD_DRIVER") != NULL;
}
static sim_stream *stream_of(cudaStream_t s) { return s ? (sim_stream *)s : sim_default_stream(); }

const char *cudaGetErrorString(int error)
{
    switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInsufficientDriver:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorHostMemoryAlreadyRegistered:
        return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
        return "pointer does not correspond to a registered memory region";
    default: return "unknown error";
    }
}

int cudaRuntimeGetVersion(int *version)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    *version = 12080;
    return cudaSuccess;
}

int cudaDriverGetVersion(int *version)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    *version = getenv("SIM_CUDA_OLD_DRIVER") ? 11080 : no_driver() ? 0 : 12080;
    return cudaSuccess;
}

int cudaGetDeviceCount(int *count)
{
    SIM_FAILPOINT(cudaErrorNoDevice);
    if (no_driver()) {
        *count = 0;
        return cudaErrorInsufficientDriver;
    }
    const char *env = getenv("SIM_CUDA_DEVICES");
    *count = env ? atoi(env) : 8;
    return cudaSuccess;
}

int cudaSetDevice(int device)
{
    SIM_FAILPOINT(cudaErrorInvalidDevice);
    int count;
    int rc = cudaGetDeviceCount(&count);
    if (rc)
        return rc;
    if (device < 0 || device >= count)
        return cudaErrorInvalidDevice;
    current_device = device;
    return cudaSuccess;
}

int cudaGetDevice(int *device)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    *device = current_device;
    return cudaSuccess;
}

int cudaStreamCreate(cudaStream_t *s)
{
    SIM_FAILPOINT(cudaErrorMemoryAllocation);
    *s = sim_stream_new();
    return cudaSuccess;
}
int cudaStreamDestroy(cudaStream_t s)
{
    SIM_FAILPOINT(cudaErrorInvalidResourceHandle);
    sim_stream_free(s);
    return cudaSuccess;
}
int cudaStreamSynchronize(cudaStream_t s)
{
    int fault = sim_should_fail(__func__); /* reported once the stream is drained */
    sim_stream_sync(stream_of(s));
    return fault ? cudaErrorLaunchFailure : cudaSuccess;
}

/* Copies: the simulated device shares the host's address space, so every kind is a memmove;
 * the asynchronous one runs in stream order. */
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    if ((!dst || !src) && count)
        return cudaErrorInvalidValue;
    sim_stream_copy(stream_of(stream), dst, src, count);
    return cudaSuccess;
}
int cudaMemcpy(void *dst, const void *src, size_t count, int kind)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    sim_stream_sync(sim_default_stream());
    memmove(dst, src, count);
    return cudaSuccess;
}

/* Host registration: remembered, so cudaPointerGetAttributes reports the range as host
 * memory and unregistering an unknown pointer fails as CUDA's does (host_alloc registers
 * each buffer: counted with the live host buffers). */
#define MAX_REGISTERED 4096
static struct { const char *base; size_t size; } registered[MAX_REGISTERED];
static int live_registrations;
static pthread_mutex_t registered_lock = PTHREAD_MUTEX_INITIALIZER;

int cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    int rc = cudaErrorMemoryAllocation;
    pthread_mutex_lock(&registered_lock);
    for (int i = 0; i < MAX_REGISTERED; i++) {
        if (registered[i].base == ptr) {
            rc = cudaErrorHostMemoryAlreadyRegistered;
            break;
        }
        if (!registered[i].base && rc == cudaErrorMemoryAllocation) {
            registered[i].base = ptr;
            registered[i].size = size;
            live_registrations++;
            rc = cudaSuccess;
            break;
        }
    }
    pthread_mutex_unlock(&registered_lock);
    return ptr && size ? rc : cudaErrorInvalidValue;
}
int cudaHostUnregister(void *ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    int rc = cudaErrorHostMemoryNotRegistered;
    pthread_mutex_lock(&registered_lock);
    for (int i = 0; i < MAX_REGISTERED; i++) {
        if (registered[i].base && registered[i].base == ptr) {
            registered[i].base = NULL;
            live_registrations--;
            rc = cudaSuccess;
        }
    }
    pthread_mutex_unlock(&registered_lock);
    return rc;
}
static int host_registered(const void *ptr)
{
    int found = 0;
    pthread_mutex_lock(&registered_lock);
    for (int i = 0; i < MAX_REGISTERED; i++)
        found |= registered[i].base && (const char *)ptr >= registered[i].base &&
                 (const char *)ptr < registered[i].base + registered[i].size;
    pthread_mutex_unlock(&registered_lock);
    return found;
}

int cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *data)
{
    SIM_FAILPOINT(cudaErrorLaunchFailure);
    if (!fn)
        return cudaErrorInvalidValue;
    sim_stream_host_fn(stream_of(stream), fn, data);
    return cudaSuccess;
}

int cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned int flags)
{
    SIM_FAILPOINT(cudaErrorMemoryAllocation);
    *ev = sim_event_new();
    return cudaSuccess;
}
int cudaEventRecord(cudaEvent_t ev, cudaStream_t stream)
{
    SIM_FAILPOINT(cudaErrorInvalidResourceHandle);
    if (!ev)
        return cudaErrorInvalidValue;
    sim_event_record(ev, stream_of(stream));
    return cudaSuccess;
}
int cudaEventSynchronize(cudaEvent_t ev)
{
    int fault = sim_should_fail(__func__); /* reported once the event is reached */
    if (!ev)
        return cudaErrorInvalidValue;
    sim_event_wait(ev);
    return fault ? cudaErrorLaunchFailure : cudaSuccess;
}
/* Not ready (600) until the stream reaches the event; a fault armed for the event's wait
 * (the work before it failed) leaves it never ready here, so the caller's blocking wait
 * reports it. */
int cudaEventQuery(cudaEvent_t ev)
{
    SIM_FAILPOINT(cudaErrorInvalidResourceHandle);
    if (!ev)
        return cudaErrorInvalidValue;
    return !sim_fail_armed("cudaEventSynchronize") && sim_event_query(ev) ? cudaSuccess
                                                                           : cudaErrorNotReady;
}
int cudaEventDestroy(cudaEvent_t ev)
{
    SIM_FAILPOINT(cudaErrorInvalidResourceHandle);
    sim_event_free(ev);
    return cudaSuccess;
}

int cudaMalloc(void **ptr, size_t size)
{
    SIM_FAILPOINT(cudaErrorMemoryAllocation);
    *ptr = size ? sim_malloc(size) : NULL;
    return *ptr ? cudaSuccess : cudaErrorInvalidValue;
}
int cudaFree(void *ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    return sim_free(ptr) == 0 ? cudaSuccess : cudaErrorInvalidValue;
}

/* cudaHostAlloc buffers: kept in a list, so cudaPointerGetAttributes and cudaFreeHost know
 * them (anywhere inside) without reading memory around a pointer they were merely handed. */
struct host_buffer {
    char *base;
    size_t size;
    struct host_buffer *next;
};
static struct host_buffer *host_buffers;
static int live_host_buffers;
static pthread_mutex_t host_buffers_lock = PTHREAD_MUTEX_INITIALIZER;

int cudaHostAlloc(void **ptr, size_t size, unsigned int flags)
{
    SIM_FAILPOINT(cudaErrorMemoryAllocation);
    if (!size)
        return cudaErrorInvalidValue;
    struct host_buffer *buf = malloc(sizeof *buf);
    char *base = malloc(size);
    if (!buf || !base) {
        free(buf);
        free(base);
        return cudaErrorMemoryAllocation;
    }
    *buf = (struct host_buffer){base, size, NULL};
    pthread_mutex_lock(&host_buffers_lock);
    buf->next = host_buffers;
    host_buffers = buf;
    live_host_buffers++;
    pthread_mutex_unlock(&host_buffers_lock);
    *ptr = base;
    return cudaSuccess;
}
int cudaFreeHost(void *ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    struct host_buffer *found = NULL;
    pthread_mutex_lock(&host_buffers_lock);
    for (struct host_buffer **at = &host_buffers; *at; at = &(*at)->next) {
        if ((*at)->base == ptr) {
            found = *at;
            *at = found->next;
            live_host_buffers--;
            break;
        }
    }
    pthread_mutex_unlock(&host_buffers_lock);
    if (!found)
        return cudaErrorInvalidValue;
    free(found->base);
    free(found);
    return cudaSuccess;
}
static int host_allocated(const void *ptr)
{
    int found = 0;
    pthread_mutex_lock(&host_buffers_lock);
    for (struct host_buffer *buf = host_buffers; buf && !found; buf = buf->next)
        found = (const char *)ptr >= buf->base && (const char *)ptr < buf->base + buf->size;
    pthread_mutex_unlock(&host_buffers_lock);
    return found;
}
int sim_live_host_buffers(void)
{
    pthread_mutex_lock(&host_buffers_lock);
    int live = live_host_buffers;
    pthread_mutex_unlock(&host_buffers_lock);
    pthread_mutex_lock(&registered_lock);
    live += live_registrations;
    pthread_mutex_unlock(&registered_lock);
    return live;
}

int cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    memset(attr, 0, sizeof *attr);
    void *base;
    uint64_t size;
    if (sim_alloc_range(ptr, &base, &size) == 0) {
        attr->type = 2;
        attr->device = current_device;
        attr->devicePointer = (void *)ptr;
        return cudaSuccess;
    }
    if (host_registered(ptr)) {
        attr->type = 1;
        attr->devicePointer = attr->hostPointer = (void *)ptr;
        return cudaSuccess;
    }
    if (host_allocated(ptr)) {
        attr->type = 1;
        attr->devicePointer = attr->hostPointer = (void *)ptr;
    }
    return cudaSuccess;
}

int cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    void *base;
    uint64_t size;
    if (sim_alloc_range(ptr, &base, &size) != 0)
        return cudaErrorInvalidValue;
    return sim_ipc_handle(base, handle->reserved) == 0 ? cudaSuccess : cudaErrorInvalidValue;
}
int cudaIpcOpenMemHandle(void **ptr, cudaIpcMemHandle_t handle, unsigned int flags)
{
    SIM_FAILPOINT(cudaErrorMapBufferObjectFailed);
    *ptr = sim_ipc_open(handle.reserved);
    return *ptr ? cudaSuccess : cudaErrorInvalidValue;
}
int cudaIpcCloseMemHandle(void *ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    return cudaSuccess;
}

/* Driver API (libcuda on real systems). */
int cuMemGetAddressRange_v2(uint64_t *base, size_t *size, uint64_t ptr)
{
    SIM_FAILPOINT(cudaErrorInvalidValue);
    void *b;
    uint64_t s;
    if (sim_alloc_range((void *)(uintptr_t)ptr, &b, &s) != 0)
        return cudaErrorInvalidValue;
    *base = (uint64_t)(uintptr_t)b;
    *size = s;
    return 0;
}

/* Test-only "kernel": after delay_us, copy n bytes (captured now) from src to dst. */
int sim_cuda_launch_write(cudaStream_t s, void *dst, const void *src, uint64_t n,
                          uint32_t delay_us)
{
    sim_stream_write(stream_of(s), dst, src, n, delay_us);
    return cudaSuccess;
}
