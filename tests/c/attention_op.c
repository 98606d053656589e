/* A stand-in for FastDeploy's attention ops (append_attention's encoder cache write on CUDA,
 * block_attn / split_rope_kvcache on XPU), reduced to what they do at the end of the encoder
 * cache write: queue the layer's K/V block writes on the stream, then post the layer signal
 * through pdhal's kernel form. Built by tests/fastdeploy/test_fastdeploy_signals.py the way an engine
 * builds its extension, against the installed header and pdhal.get_library(), once per
 * simulated runtime (-DATTENTION_OP_CUDA or -DATTENTION_OP_XPU, linked against that
 * runtime's .so). No Python here: the library includes only pdhal.h and declares the few
 * runtime functions it calls, so the post path (the op's launch line, the stream's host
 * function, the sender thread) runs no Python at all.
 *
 * Return codes: 0; a runtime's own error code (> 0) when a runtime call failed; -EINVAL
 * when pdhal refused the kernel form (pdhal_last_error() says why, on this thread). */
#define _GNU_SOURCE
#include "pdhal.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

/* One K or V block range of the layer, written by the "kernel" after delay_us. */
struct kv_write {
    void *dst;
    const void *src; /* captured at launch: the caller may free it right after */
    uint64_t bytes;
};

/* A test gate: a host function that holds its stream until gate_open. The tests queue it
 * before an op's launches, so that what the engine does right after a launch (dropping the
 * kernel-form tensor, overwriting its memory) provably happens before the device posts. */
struct gate {
    pthread_mutex_t lock;
    pthread_cond_t opened;
    int open;
};

void *gate_new(void)
{
    struct gate *g = calloc(1, sizeof *g);
    if (g) {
        pthread_mutex_init(&g->lock, NULL);
        pthread_cond_init(&g->opened, NULL);
    }
    return g;
}

static void gate_pass(void *arg) /* on the stream's thread */
{
    struct gate *g = arg;
    pthread_mutex_lock(&g->lock);
    while (!g->open)
        pthread_cond_wait(&g->opened, &g->lock);
    pthread_mutex_unlock(&g->lock);
}

void gate_open(void *gate)
{
    struct gate *g = gate;
    pthread_mutex_lock(&g->lock);
    g->open = 1;
    pthread_cond_broadcast(&g->opened);
    pthread_mutex_unlock(&g->lock);
}

void gate_free(void *gate)
{
    struct gate *g = gate;
    pthread_mutex_destroy(&g->lock);
    pthread_cond_destroy(&g->opened);
    free(g);
}

#if defined(ATTENTION_OP_CUDA)

typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *);
int cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *data);
int cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
int cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
int cudaEventQuery(cudaEvent_t event);
int cudaEventDestroy(cudaEvent_t event);
/* The simulated runtime's test kernel: after delay_us, write n bytes (taken now) at dst. */
int sim_cuda_launch_write(cudaStream_t stream, void *dst, const void *src, uint64_t n,
                          uint32_t delay_us);

static int write_cache(cudaStream_t stream, const struct kv_write *writes, int count,
                       uint32_t delay_us)
{
    for (int i = 0; i < count; i++) {
        int rc = sim_cuda_launch_write(stream, writes[i].dst, writes[i].src, writes[i].bytes,
                                       delay_us);
        if (rc)
            return rc;
    }
    return 0;
}

static int launch_store(cudaStream_t stream, pdhal_store *store)
{
    if (!store)
        return -EINVAL; /* pdhal_last_error() has the reason */
    int rc = cudaLaunchHostFunc(stream, pdhal_store_run, store);
    if (rc)
        pdhal_store_free(store); /* the launch failed: it will never run */
    return rc;
}

/* Per query: kv_signal_data is the int64 data of the layer's kernel-form tensor
 * (init_signal_layerwise), read during this call only. */
int attention_cuda_per_query(cudaStream_t stream, const struct kv_write *writes, int count,
                             uint32_t delay_us, const int64_t *kv_signal_data)
{
    int rc = write_cache(stream, writes, count, delay_us);
    return rc ? rc : launch_store(stream, pdhal_signal_store(kv_signal_data));
}

/* Per chunk: "the next layer of the current step", no signal argument. */
int attention_cuda_per_chunk(cudaStream_t stream, const struct kv_write *writes, int count,
                             uint32_t delay_us)
{
    int rc = write_cache(stream, writes, count, delay_us);
    return rc ? rc : launch_store(stream, pdhal_next_chunk_layer_store());
}

/* The header's launch line as written, unchecked: a refused kernel form launches
 * pdhal_store_run(NULL), which stores nothing. Returns the launch's code. */
int attention_cuda_unchecked(cudaStream_t stream, const int64_t *kv_signal_data)
{
    return cudaLaunchHostFunc(stream, pdhal_store_run, pdhal_signal_store(kv_signal_data));
}

int gate_close(void *gate, cudaStream_t stream)
{
    return cudaLaunchHostFunc(stream, gate_pass, gate);
}

/* Open the gate and wait until `stream` has run everything queued so far (every host
 * function: every store) or until timeout_ns: 0, -ETIMEDOUT, or a runtime error. The tests
 * call it through ctypes.PyDLL, i.e. holding the GIL: were any Python on the post path,
 * the stream would stall behind this call and it would time out. */
int gate_open_and_drain(void *gate, cudaStream_t stream, const int64_t *sender_words,
                        int64_t timeout_ns)
{
    (void)sender_words; /* a CUDA stream posts by itself */
    cudaEvent_t done;
    int rc = cudaEventCreateWithFlags(&done, 0);
    if (rc)
        return rc;
    rc = cudaEventRecord(done, stream);
    gate_open(gate);
    int64_t deadline = pdhal_now_ns() + timeout_ns;
    while (!rc && cudaEventQuery(done) != 0) {
        if (pdhal_now_ns() > deadline)
            return -ETIMEDOUT; /* `done` is left: its record is still queued */
        sched_yield();
    }
    cudaEventDestroy(done);
    return rc;
}

/* The launch line alone, N times, for bench/bench_kernel_post.py: the host-side cost of
 * posting a layer from an op (the kernel-form lookup and cudaLaunchHostFunc). Per query
 * when words is non-NULL, else per chunk. Returns the nanoseconds taken, or -errno. */
int64_t bench_cuda_posts(cudaStream_t stream, const int64_t *words, int n)
{
    int64_t start = pdhal_now_ns();
    for (int i = 0; i < n; i++) {
        pdhal_store *store = words ? pdhal_signal_store(words) : pdhal_next_chunk_layer_store();
        int rc = launch_store(stream, store);
        if (rc)
            return rc < 0 ? rc : -EIO;
    }
    return pdhal_now_ns() - start;
}

#elif defined(ATTENTION_OP_XPU)

typedef void *XPUStream;
typedef void *XPUEvent;
int xpu_event_create(XPUEvent *event);
int xpu_event_record(XPUEvent event, XPUStream stream);
int xpu_event_query(XPUEvent event);
int xpu_event_destroy(XPUEvent event);
int sim_xpu_launch_write(XPUStream stream, void *dst, const void *src, uint64_t n,
                         uint32_t delay_us);
/* XPU has no host functions: the gate uses the simulator's own (tests only). */
void sim_stream_host_fn(void *stream, void (*fn)(void *), void *arg);

static int write_cache(XPUStream stream, const struct kv_write *writes, int count,
                       uint32_t delay_us)
{
    for (int i = 0; i < count; i++) {
        int rc = sim_xpu_launch_write(stream, writes[i].dst, writes[i].src, writes[i].bytes,
                                      delay_us);
        if (rc)
            return rc;
    }
    return 0;
}

/* After the writes: an event behind them, handed with the layer's store to the sender that
 * sender_words (create_kv_signal_sender's tensor) names. Both are looked up before the
 * event is recorded, so a refused kernel form costs no event (FastDeploy's op checks its
 * worker pointer after recording, which works too: see attention_xpu_post_line). */
static int post_through_sender(XPUStream stream, int per_chunk, const int64_t *kv_signal_data,
                               const int64_t *sender_words)
{
    pdhal_sender *sender = pdhal_kernel_sender(sender_words);
    if (!sender)
        return -EINVAL; /* pdhal_last_error() has the reason */
    pdhal_store *store = per_chunk ? pdhal_next_chunk_layer_store()
                                   : pdhal_signal_store(kv_signal_data);
    if (!store)
        return -EINVAL;
    XPUEvent e;
    int rc = xpu_event_create(&e);
    if (rc) {
        pdhal_store_free(store);
        return rc;
    }
    rc = xpu_event_record(e, stream);
    if (rc) {
        xpu_event_destroy(e);
        pdhal_store_free(store);
        return rc;
    }
    return pdhal_sender_post(sender, e, store); /* owns e and store from here, also on error */
}

/* The header's one-line post through a sender, as written: a refused signal comes back as
 * the post's -EINVAL, the reason in pdhal_last_error(), the event destroyed by the post
 * (its record may still be queued: runtimes allow that); a dead sender is -EBADF, the event
 * left to us. */
int attention_xpu_post_line(XPUStream stream, const int64_t *kv_signal_data,
                            const int64_t *sender_words)
{
    XPUEvent event;
    int rc = xpu_event_create(&event);
    if (rc)
        return rc;
    rc = xpu_event_record(event, stream);
    if (rc) {
        xpu_event_destroy(event);
        return rc;
    }
    rc = pdhal_sender_post(pdhal_kernel_sender(sender_words), event,
                           pdhal_signal_store(kv_signal_data));
    if (rc == -EBADF)
        xpu_event_destroy(event);
    return rc;
}

int attention_xpu_per_query(XPUStream stream, const struct kv_write *writes, int count,
                            uint32_t delay_us, const int64_t *kv_signal_data,
                            const int64_t *sender_words)
{
    int rc = write_cache(stream, writes, count, delay_us);
    return rc ? rc : post_through_sender(stream, 0, kv_signal_data, sender_words);
}

int attention_xpu_per_chunk(XPUStream stream, const struct kv_write *writes, int count,
                            uint32_t delay_us, const int64_t *sender_words)
{
    int rc = write_cache(stream, writes, count, delay_us);
    return rc ? rc : post_through_sender(stream, 1, NULL, sender_words);
}

int gate_close(void *gate, XPUStream stream)
{
    sim_stream_host_fn(stream, gate_pass, gate);
    return 0;
}

/* As the CUDA one, and then until the sender named by sender_words has run every store
 * queued (pending 0): its thread, not the stream, posts on XPU. */
int gate_open_and_drain(void *gate, XPUStream stream, const int64_t *sender_words,
                        int64_t timeout_ns)
{
    pdhal_sender *sender = pdhal_kernel_sender(sender_words);
    if (!sender)
        return -EINVAL;
    XPUEvent done;
    int rc = xpu_event_create(&done);
    if (rc)
        return rc;
    rc = xpu_event_record(done, stream);
    gate_open(gate);
    int64_t deadline = pdhal_now_ns() + timeout_ns;
    while (!rc && (xpu_event_query(done) != 0 || pdhal_sender_pending(sender) != 0)) {
        if (pdhal_now_ns() > deadline)
            return -ETIMEDOUT; /* `done` is left: its record may still be queued */
        sched_yield();
    }
    xpu_event_destroy(done);
    return rc;
}

#else
#error "build with -DATTENTION_OP_CUDA or -DATTENTION_OP_XPU"
#endif
