/* sim_device.h: a pretend accelerator for tests, shared by the simulated vendor runtimes.
 *
 * Streams are worker threads running queued work in order; events fire when their stream
 * reaches them; device memory lives in shared-memory files so another process can map it
 * (IPC) and so a second "peer" mapping of the same bytes can stand in for an RDMA alias.
 * Nothing here is fast or clever: it exists to make ordering bugs visible. */
#ifndef SIM_DEVICE_H
#define SIM_DEVICE_H

#include <stdint.h>

typedef struct sim_stream sim_stream;
typedef struct sim_event sim_event;

sim_stream *sim_stream_new(void);
void sim_stream_free(sim_stream *s);         /* drains first */
sim_stream *sim_default_stream(void);
void sim_stream_sync(sim_stream *s);          /* returns when all queued work has run */
void sim_stream_host_fn(sim_stream *s, void (*fn)(void *), void *arg);
/* A device copy in stream order: src is read when the stream reaches it (after the work
 * queued before), as a runtime's asynchronous memcpy does. */
void sim_stream_copy(sim_stream *s, void *dst, const void *src, uint64_t n);
/* Test-only kernel: sleep delay_us, then copy n bytes from src to dst. */
void sim_stream_write(sim_stream *s, void *dst, const void *src, uint64_t n, uint32_t delay_us);

sim_event *sim_event_new(void);
void sim_event_free(sim_event *e);
void sim_event_record(sim_event *e, sim_stream *s);
void sim_event_wait(sim_event *e);            /* blocks until the last record has run */
int sim_event_query(sim_event *e);            /* 1 once the last record has run, else 0 */
void sim_stream_wait_event(sim_stream *s, sim_event *e);

/* Device memory (shared-memory backed). */
void *sim_malloc(uint64_t size);
int sim_free(void *ptr);                       /* -1 when ptr is not an allocation */
/* Fills handle (64 bytes) for the allocation holding ptr; -1 if none. */
int sim_ipc_handle(void *ptr, char handle[64]);
void *sim_ipc_open(const char handle[64]);
/* Base and size of the allocation holding ptr; -1 if none. */
int sim_alloc_range(const void *ptr, void **base, uint64_t *size);
/* A second mapping of the allocation holding ptr, at the same offset; NULL if unknown. */
void *sim_peer_alias(const void *ptr);

/* Failure injection, set at run time by a test: the next `count` calls of the runtime entry
 * point named `function` fail (count -1: every call; 0: stop failing). Returns 0, or -1 when
 * the name is too long or the table of names is full. SIM_FAIL="name[:count],..." in the
 * environment does the same when the library is loaded (no count: every call), so a child
 * process can be told too. Each simulated runtime holds its own table. A failing wait
 * (event or stream) still waits, then fails, like a fault in the work before it: the
 * caller may destroy the event at once, as after any wait. */
int sim_fail(const char *function, int count);
/* Forget every injected failure and every count. */
void sim_fail_clear(void);
/* How many calls of `function` have been made to fail so far. */
int sim_failed_calls(const char *function);
/* Whether a failure of `function` is armed (consumes nothing). */
int sim_fail_armed(const char *function);
/* Whether this call of `function` is to fail (consumes one of its count). */
int sim_should_fail(const char *function);
/* The first statement of a runtime entry point: return `code` when a test asked for it. */
#define SIM_FAILPOINT(code)                                                                     \
    do {                                                                                         \
        if (sim_should_fail(__func__))                                                           \
            return (code);                                                                       \
    } while (0)

/* Leak accounting for tests. */
int sim_live_events(void);
int sim_live_streams(void);
int sim_live_threads(void);

#endif
