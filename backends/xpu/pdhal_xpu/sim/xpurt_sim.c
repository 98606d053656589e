/* xpurt_sim.c: a simulated Kunlunxin XPU runtime (libxpurt.so) for tests on machines
 * without an XPU. It exports the runtime's C ABI that pdhal-xpu binds (its cdef lists the
 * calls), backed by sim_device.
 * Built twice: the full runtime, and with -DSIM_OLD_RUNTIME one without the KL3 additions
 * (IPC handles and the CUDA-compatible cudaPointerGetAttributes), like older runtimes.
 * Error codes: 0 success, XPUERR_INVALID for a bad argument. Device count: SIM_XPU_DEVICES
 * (default 8). Every xpu_* entry point (and cudaPointerGetAttributes) can be told to fail, see
 * sim_fail in sim_device.h: allocations with XPUERR_NOMEM, waits with XPUERR_KEXCEPTION (a
 * kernel fault before the event), the device count with XPUERR_NODEV, others XPUERR_INVALID.
 * The values are the simulator's own; pdhal relies only on "non-zero is an error". */
#define _GNU_SOURCE
#include "sim_device.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define XPUERR_INVALID 1
#define XPUERR_BUSY 16 /* not done yet */
#define XPUERR_NODEV 2
#define XPUERR_NOMEM 3
#define XPUERR_KEXCEPTION 12

typedef void *XPUStream;
typedef void *XPUEvent;

static _Thread_local int current_device;
static atomic_int live_host_buffers;

static int device_count(void)
{
    const char *env = getenv("SIM_XPU_DEVICES");
    return env ? atoi(env) : 8;
}

static sim_stream *stream_of(XPUStream s) { return s ? (sim_stream *)s : sim_default_stream(); }

int xpu_device_count(int *count)
{
    SIM_FAILPOINT(XPUERR_NODEV);
    *count = device_count();
    return 0;
}
int xpu_current_device(int *devid)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    *devid = current_device;
    return 0;
}
int xpu_set_device(int devid)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    if (devid < 0 || devid >= device_count())
        return XPUERR_INVALID;
    current_device = devid;
    return 0;
}
int xpu_get_runtime_version(uint32_t *major, uint32_t *minor)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    *major = 4;
    *minor = 31;
    return 0;
}

int xpu_malloc(void **ptr, uint64_t size, int kind)
{
    SIM_FAILPOINT(XPUERR_NOMEM);
    *ptr = size && kind == 0 ? sim_malloc(size) : NULL;
    return *ptr ? 0 : XPUERR_INVALID;
}
int xpu_free(void *ptr)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    return sim_free(ptr) == 0 ? 0 : XPUERR_INVALID;
}

int xpu_host_alloc(void **ptr, uint64_t size, unsigned int flags)
{
    SIM_FAILPOINT(XPUERR_NOMEM);
    if (!size || flags)
        return XPUERR_INVALID;
    /* A header in front lets xpu_host_free refuse memory it did not hand out. */
    uint64_t *raw = malloc(size + 16);
    if (!raw)
        return XPUERR_INVALID;
    raw[0] = 0x5850554841ULL; /* "XPUHA" */
    atomic_fetch_add(&live_host_buffers, 1);
    *ptr = raw + 2;
    return 0;
}
int xpu_host_free(void *ptr)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    uint64_t *raw = (uint64_t *)ptr - 2;
    if (!ptr || raw[0] != 0x5850554841ULL)
        return XPUERR_INVALID;
    raw[0] = 0;
    free(raw);
    atomic_fetch_sub(&live_host_buffers, 1);
    return 0;
}
int sim_live_host_buffers(void) { return live_host_buffers; }

int xpu_memcpy(void *dst, const void *src, uint64_t size, int kind)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    if (kind < 0 || kind > 2)
        return XPUERR_INVALID;
    sim_stream_sync(sim_default_stream()); /* synchronous: after the default stream's work */
    memmove(dst, src, size);
    return 0;
}
/* In stream order: the source is read when the stream reaches the copy. kind is
 * XPUMemcpyKind (0 device to host, 1 host to device, 2 device to device). */
int xpu_memcpy_async(void *dst, const void *src, uint64_t size, int kind, XPUStream stream)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    if (kind < 0 || kind > 2 || ((!dst || !src) && size))
        return XPUERR_INVALID;
    sim_stream_copy(stream_of(stream), dst, src, size);
    return 0;
}

int xpu_event_create(XPUEvent *ev)
{
    SIM_FAILPOINT(XPUERR_NOMEM);
    *ev = sim_event_new();
    return 0;
}
int xpu_event_record(XPUEvent ev, XPUStream stream)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    if (!ev)
        return XPUERR_INVALID;
    sim_event_record(ev, stream_of(stream));
    return 0;
}
int xpu_event_wait(XPUEvent ev)
{
    int fault = sim_should_fail(__func__); /* reported once the event is reached */
    if (!ev)
        return XPUERR_INVALID;
    sim_event_wait(ev);
    return fault ? XPUERR_KEXCEPTION : 0;
}
/* 0 once the stream reached the event, XPUERR_BUSY before; a fault armed for the event's
 * wait leaves it never ready here, so the blocking wait reports it. */
int xpu_event_query(XPUEvent ev)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    if (!ev)
        return XPUERR_INVALID;
    return !sim_fail_armed("xpu_event_wait") && sim_event_query(ev) ? 0 : XPUERR_BUSY;
}
int xpu_event_destroy(XPUEvent ev)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    sim_event_free(ev);
    return 0;
}
int xpu_stream_create(XPUStream *s)
{
    SIM_FAILPOINT(XPUERR_NOMEM);
    *s = sim_stream_new();
    return 0;
}
int xpu_stream_destroy(XPUStream s)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    sim_stream_free(s);
    return 0;
}
int xpu_stream_wait_event(XPUStream s, XPUEvent ev)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    sim_stream_wait_event(stream_of(s), ev);
    return 0;
}
int xpu_wait(XPUStream s)
{
    int fault = sim_should_fail(__func__); /* reported once the stream is drained */
    sim_stream_sync(stream_of(s));
    return fault ? XPUERR_KEXCEPTION : 0;
}

/* Test-only "kernel": after delay_us, copy n bytes (captured now) from src to dst. */
int sim_xpu_launch_write(XPUStream s, void *dst, const void *src, uint64_t n, uint32_t delay_us)
{
    sim_stream_write(stream_of(s), dst, src, n, delay_us);
    return 0;
}

#ifndef SIM_OLD_RUNTIME
typedef struct {
    char reserved[64];
} XPUIpcMemHandle;

int xpu_ipc_get_memhandle(XPUIpcMemHandle *handle, void *devptr)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    return sim_ipc_handle(devptr, handle->reserved) == 0 ? 0 : XPUERR_INVALID;
}
int xpu_ipc_open_memhandle(void **devptr, XPUIpcMemHandle handle, unsigned int flags)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    *devptr = sim_ipc_open(handle.reserved);
    return *devptr ? 0 : XPUERR_INVALID;
}

/* The CUDA-compatible layer: hostPointer is the peer alias an RDMA NIC can register. */
struct cudaPointerAttributes {
    int type;
    int device;
    void *devicePointer;
    void *hostPointer;
};
int cudaPointerGetAttributes(struct cudaPointerAttributes *attr, const void *ptr)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    memset(attr, 0, sizeof *attr);
    attr->hostPointer = sim_peer_alias(ptr);
    if (attr->hostPointer) {
        attr->type = 2; /* device */
        attr->devicePointer = (void *)ptr;
    }
    return 0;
}

/* Host registration of the CUDA-compatible layer: remembered, so unregistering memory that
 * was never registered fails (host_alloc registers each buffer: counted with the live host
 * buffers). */
#define MAX_REGISTERED 4096
static void *registered[MAX_REGISTERED];
static pthread_mutex_t registered_lock = PTHREAD_MUTEX_INITIALIZER;

int cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    if (!ptr || !size)
        return XPUERR_INVALID;
    int rc = XPUERR_INVALID;
    pthread_mutex_lock(&registered_lock);
    for (int i = 0; i < MAX_REGISTERED && rc; i++)
        if (!registered[i]) {
            registered[i] = ptr;
            atomic_fetch_add(&live_host_buffers, 1);
            rc = 0;
        }
    pthread_mutex_unlock(&registered_lock);
    return rc;
}
int cudaHostUnregister(void *ptr)
{
    SIM_FAILPOINT(XPUERR_INVALID);
    int rc = XPUERR_INVALID;
    pthread_mutex_lock(&registered_lock);
    for (int i = 0; i < MAX_REGISTERED && rc; i++)
        if (ptr && registered[i] == ptr) {
            registered[i] = NULL;
            atomic_fetch_sub(&live_host_buffers, 1);
            rc = 0;
        }
    pthread_mutex_unlock(&registered_lock);
    return rc;
}
#endif

/* Test-only: when the stream reaches this point, store CLOCK_MONOTONIC ns into *dst (lets a
 * benchmark know when the work before a signal really finished). */
static void store_time(void *dst)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *(volatile uint64_t *)dst = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}
int sim_xpu_launch_timestamp(XPUStream s, uint64_t *dst)
{
    sim_stream_host_fn(stream_of(s), store_time, dst);
    return 0;
}
