/*
 * pdhal.h: the C core of pdhal, usable from engine kernels (C/C++) and from Python (cffi).
 *
 * Everything between PDHAL_CDEF_BEGIN and PDHAL_CDEF_END is ALSO the cffi cdef: the build
 * script reads it from this file, so the compiler's view and Python's view cannot drift.
 * Keep that region free of preprocessor logic other than integer #defines.
 *
 * Conventions: every function returning int returns 0 (or a documented count) on success and
 * -errno on failure; pdhal_last_error() then holds a human-readable detail for this thread.
 * Progress values are 64-bit words: (step << PDHAL_LAYER_BITS) | (layer + 1); 0 in the low
 * bits means "step started, no layer ready yet". The word only ever grows.
 */
#ifndef PDHAL_H
#define PDHAL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* PDHAL_CDEF_BEGIN */
#define PDHAL_ABI_VERSION 2
#define PDHAL_SEGMENT_VERSION 2
#define PDHAL_LAYER_BITS 20
#define PDHAL_MAX_LAYER 1048574
#define PDHAL_MAX_REQUESTS 512
#define PDHAL_RECORD_WORDS 1538
#define PDHAL_DEFAULT_RING_SLOTS 16
#define PDHAL_QUERY_SLOT 4294967295

/* Kernel forms: PDHAL_KERNEL_WORDS int64 words, word 0 one of these tags. */
#define PDHAL_KERNEL_WORDS 4
#define PDHAL_KERNEL_SIGNAL 5783827313963565057 /* "PDHLK" 0 0 1 */
#define PDHAL_KERNEL_NOOP 5783827313963565058
#define PDHAL_KERNEL_SENDER 5783827313963565059

/* Segment kinds (the header's `kind` field). */
#define PDHAL_KIND_QUERY 1
#define PDHAL_KIND_CHUNK 2
#define PDHAL_KIND_BUFFER 3

/* Flags of pdhal_segment_open. */
#define PDHAL_OPEN_EXCLUSIVE_READER 1
#define PDHAL_OPEN_LIVE_PRODUCER 2
#define PDHAL_OPEN_UNINTERRUPTED 4

typedef struct pdhal_segment pdhal_segment;
typedef struct pdhal_store pdhal_store;
typedef struct pdhal_sender pdhal_sender;

/* Device hooks a backend hands to a sender: block until `event` has fired (0; anything else,
 * e.g. a vendor error code, is a failure), and release it. Called on the sender thread,
 * never with the GIL. */
typedef int (*pdhal_event_wait_fn)(void *event);
typedef int (*pdhal_event_destroy_fn)(void *event); /* result ignored */
/* Non-blocking: 0 once `event` has fired, anything else while it has not (or failed: the
 * blocking wait tells which). cudaEventQuery and xpu_event_query have this shape. */
typedef int (*pdhal_event_query_fn)(void *event);

/* PDHAL_ABI_VERSION of the compiled core: a caller built against another header refuses it. */
int pdhal_abi_version(void);
/* Detail of the last failure on this thread (never NULL). */
const char *pdhal_last_error(void);
/* CLOCK_MONOTONIC in nanoseconds: deadlines below are absolute values of this clock. */
int64_t pdhal_now_ns(void);

/* ---- segments (segment.c) ---- */
/* Create the segment at `path` as its producer: exclusive create, mode 0600, header filled
 * before the mode says "ready", producer lock held for the handle's life, every byte of the
 * file reserved (-ENOSPC, naming the folder, when it does not fit: never a SIGBUS later). A
 * segment left by a dead producer is reclaimed; a live one gives -EBUSY. `body_bytes` is the
 * payload size for PDHAL_KIND_BUFFER, ignored otherwise. A folder that others may write
 * without the sticky bit is refused (-EPERM). */
int pdhal_segment_create(const char *path, uint32_t kind, uint64_t body_bytes, uint32_t ring_slots,
                         pdhal_segment **out);
/* Open an existing segment, waiting until `deadline_ns` for it to exist and be initialised
 * (-ENOENT or -ETIMEDOUT after it). Without PDHAL_OPEN_UNINTERRUPTED it returns -EINTR each
 * 200 ms slice, as the waits below, so Python can run signal handlers: call it again with the
 * same deadline, or the open fails whenever the producer starts more than a slice late (under
 * load, not in a quick test). PDHAL_OPEN_UNINTERRUPTED (for C callers with no handlers to
 * run) waits through the slices itself until the deadline.
 * Validates owner, mode, magic, version, kind, size and layout, then copies the layout into
 * the handle: later changes to the shared header are never trusted. Flags:
 * PDHAL_OPEN_EXCLUSIVE_READER takes the per-chunk single-reader lock (-EBUSY if another
 * reader holds it); PDHAL_OPEN_LIVE_PRODUCER treats a segment whose producer died like a
 * missing one (wait for its successor). A per-query reader is counted as attached
 * (pdhal_segment_reader_attached) while its handle is open. */
int pdhal_segment_open(const char *path, uint32_t kind, int64_t deadline_ns, uint32_t flags,
                       pdhal_segment **out);
/* Drop the handle: the creator (in its own process) unlinks the name; the mapping lives on
 * while signals posted through it are pending. NULL is a no-op. */
void pdhal_segment_close(pdhal_segment *seg);
/* 1 while the segment's producer holds its lock, 0 once it is gone, or -errno. */
int pdhal_segment_producer_alive(pdhal_segment *seg);
/* 1 while a reader is attached (per chunk: the single reader; per query: any reader), 0
 * otherwise, or -errno. */
int pdhal_segment_reader_attached(pdhal_segment *seg);
/* Pid of the process that created the segment (as its header says; for messages only). */
int32_t pdhal_segment_creator_pid(pdhal_segment *seg);
/* Steps in the ring of a PDHAL_KIND_CHUNK segment (as validated at open), else 0. */
uint32_t pdhal_segment_ring_slots(pdhal_segment *seg);
/* Payload of a PDHAL_KIND_BUFFER segment (page aligned; NULL for other kinds), valid while
 * the handle is, and its size in bytes (as validated at open). */
void *pdhal_segment_body(pdhal_segment *seg);
uint64_t pdhal_segment_body_bytes(pdhal_segment *seg);
/* Unlink `path` if it is one of our pdhal segments whose producer is dead: 1 removed, 0 left
 * (alive or gone already), -errno when it is not ours to judge. Safe against concurrent
 * reclaimers and never touches a live segment. */
int pdhal_segment_reclaim(const char *path);

/* ---- per-query progress (progress.c) ---- */
/* The per-query progress word now (acquire: what was written before it is visible). */
uint64_t pdhal_progress_load(pdhal_segment *seg);
/* Start step+1 with no layer (one atomic compare-and-swap, so threads starting steps at once
 * each get their own); returns the new step in *step. */
int pdhal_progress_begin_step(pdhal_segment *seg, uint64_t *step);
/* Publish `value` into the progress word of `slot` (PDHAL_QUERY_SLOT or a ring slot) if it
 * is larger than what is there, then wake waiters. Safe from any thread, lock-free. A slot
 * outside the ring stores nothing. */
void pdhal_progress_publish(pdhal_segment *seg, uint32_t slot, uint64_t value);
/* Wait until the per-query progress exceeds `since`: 0 with *now set, -ETIMEDOUT,
 * -EINTR (a signal arrived or a 200 ms slice ended: let the caller's signal handlers run,
 * then call again with the same deadline), or -EOWNERDEAD when the producer died. Spins
 * `spin_ns` first (within the deadline). Blocking calls below return -EINTR the same way. */
int pdhal_progress_wait(pdhal_segment *seg, uint64_t since, int64_t deadline_ns, uint32_t spin_ns,
                        uint64_t *now);

/* ---- per-chunk ring (ring.c) ---- */
/* Publish the next step's request table (count triples of slot, cached, chunk tokens) into
 * the ring. Waits, until deadline, for the reader (attached or not yet) to finish the step
 * whose slot is reused (-ETIMEDOUT); -EPIPE at once if a reader had attached and died.
 * Returns the step in *step. Threads of one process may call it at once: they publish one
 * after the other, each its own step. */
int pdhal_ring_begin_step(pdhal_segment *seg, const int32_t *table, uint32_t count,
                          uint32_t num_layers, int64_t deadline_ns, uint64_t *step);
/* Deliver the next (step, layer) record into out: [count, layer, triples...]. Returns 1 when
 * a record was written, 0 when none is pending and the deadline has passed (deadline 0 means
 * "do not wait"), -ENOBUFS if `capacity` words cannot hold it (nothing consumed), -EINTR,
 * -EOWNERDEAD. *step gets the record's step. Spins `spin_ns` (within the deadline) before
 * sleeping. Needs a handle opened with PDHAL_OPEN_EXCLUSIVE_READER (-EPERM otherwise), used
 * by one thread at a time (-EBUSY while another thread is inside a call on it).
 * Calling it acknowledges every record delivered before (see pdhal_ring_ack). */
int pdhal_ring_next(pdhal_segment *seg, int32_t *out, uint32_t capacity, int64_t deadline_ns,
                    uint32_t spin_ns, uint64_t *step);
/* Acknowledge every record delivered so far: a step counts as finished (its ring slot free
 * for the producer, and skipped by a restarted reader) once its last layer was delivered AND
 * acknowledged, here or by the next pdhal_ring_next. A reader that dies before that gets the
 * step again, from layer 0, when it restarts: delivery is at least once across a crash and
 * exactly once otherwise. Same handle rules as pdhal_ring_next. */
int pdhal_ring_ack(pdhal_segment *seg);

/* ---- pending stores (progress.c) ---- */
/* A progress store to run later, e.g. from a device host function. Holds the segment's
 * mapping alive until it runs. NULL (pdhal_last_error says why) when out of memory or when
 * `slot` is neither PDHAL_QUERY_SLOT nor a slot of the segment's ring. */
pdhal_store *pdhal_store_new(pdhal_segment *seg, uint32_t slot, uint64_t value);
/* Run the store and free it: matches the CUDA host function signature void(*)(void *).
 * NULL does nothing. */
void pdhal_store_run(void *store);
/* Free a store that will never run (e.g. the launch failed). */
void pdhal_store_free(pdhal_store *store);

/* ---- async sender (sender.c) ---- */
/* Start a sender: one long-lived thread, with every signal blocked, until destroy. `wait`
 * may be NULL (no device events: stores run in queue order). 0 with *out set, or -errno. */
int pdhal_sender_create(pdhal_event_wait_fn wait, pdhal_event_destroy_fn destroy,
                        pdhal_sender **out);
/* Queue (event, store): the thread waits for the event, runs the store, destroys the event.
 * Takes ownership of both, also on failure; a store that stores nothing (a no-op kernel
 * form) destroys the event at once. A NULL store is -EINVAL (the event destroyed). A NULL
 * sender is -EBADF, and the only case where the event stays the caller's to destroy (no
 * sender, no destroy function): a caller tells the two apart by the code alone. Safe from
 * several threads, but not concurrently with pdhal_sender_destroy; -ECHILD in a forked
 * child. */
int pdhal_sender_post(pdhal_sender *sender, void *event, pdhal_store *store);
/* Poll each queued event with `query` (yielding between polls) for up to poll_ns before the
 * blocking wait: a layer is signalled within microseconds of its event rather than after a
 * blocking wait's wake-up, at the price of a busy thread while work is queued; with nothing
 * queued the thread sleeps. query NULL turns polling off. 0 or -errno. */
int pdhal_sender_set_polling(pdhal_sender *sender, pdhal_event_query_fn query, uint64_t poll_ns);
/* Deliver everything queued, join the thread, free. Returns the number of stores dropped
 * because their event wait failed (0 in a healthy run), or -errno. */
int pdhal_sender_destroy(pdhal_sender *sender);
/* Entries queued but not delivered yet. */
uint64_t pdhal_sender_pending(pdhal_sender *sender);
/* Event waits that failed so far (their stores were not run). */
uint64_t pdhal_sender_failures(pdhal_sender *sender);
/* ---- kernel forms (kernel.c) ----
 * A device op (C/C++: an attention kernel's launcher) receives a layer signal or a sender as
 * an int64 tensor of PDHAL_KERNEL_WORDS words, from Python's kernel_form. The words name
 * things registered in this process (with a generation), never a pointer: a stale, freed or
 * garbage tensor is refused with an error, never dereferenced. Each function reads the
 * words once, during the call, so the engine may drop the tensor right after the launch.
 *
 * Per query, after the layer's cache writes, on a CUDA stream:
 *     cudaLaunchHostFunc(stream, pdhal_store_run, pdhal_signal_store(kv_signal_data));
 * Through a sender (a device without host functions), after recording `event`:
 *     if (pdhal_sender_post(pdhal_kernel_sender(sender_words), event,
 *                           pdhal_signal_store(kv_signal_data)) == -EBADF)
 *         xpu_event_destroy(event); // no live sender took it
 * Per chunk, "the next layer of the current step", with no signal argument:
 *     cudaLaunchHostFunc(stream, pdhal_store_run, pdhal_next_chunk_layer_store());
 */
/* The pending store of the layer signal `words` (tag PDHAL_KERNEL_SIGNAL): run it from the
 * device (pdhal_store_run). For PDHAL_KERNEL_NOOP (a step with nothing to report) a store
 * that stores nothing. NULL, with pdhal_last_error set, when the words are not a live
 * signal of this process; pdhal_store_run(NULL) does nothing, so a launch line that does
 * not check still never crashes. */
pdhal_store *pdhal_signal_store(const int64_t *words);
/* The pending store of the next layer of this process's current per-chunk step (the step
 * pdhal_ring_begin_step published last, in this process): layers are numbered in the order
 * of these calls, from 0 at each step start. NULL (with the reason) when no step is
 * current, e.g. a step without prefill requests, or when every layer of the step was taken
 * already. Thread-safe; a process producing several per-chunk channels at once (threads
 * starting steps concurrently) names each layer by its signal words instead. */
pdhal_store *pdhal_next_chunk_layer_store(void);
/* Make (seg, step, num_layers) the current per-chunk step of this process, its next layer
 * 0 (pdhal_ring_begin_step does it for each step it publishes, under its lock).
 * num_layers 0 clears it if `seg` is the current step's channel (a step of that channel
 * with no prefill request); seg NULL clears it whatever it is. 0 or -errno. */
int pdhal_chunk_set_current(pdhal_segment *seg, uint64_t step, uint32_t num_layers);
/* The kernel-form id of a producer channel: registers `seg` (once) so signal words can name
 * it; the registration ends when the handle is closed. 0 on failure (table full). */
int64_t pdhal_kernel_channel(pdhal_segment *seg);
/* The sender named by `words` (tag PDHAL_KERNEL_SENDER) while it lives; NULL with the
 * reason otherwise. Must not race with that sender's destroy. */
pdhal_sender *pdhal_kernel_sender(const int64_t *words);
/* The kernel-form id of a sender (every sender is registered from create to destroy). */
int64_t pdhal_sender_kernel_id(pdhal_sender *sender);

/* ---- guarded copies (fault.c) ---- */
/* Copy `bytes` from `src` to `dst` (host memory) where `dst` is a shared mapping its owner
 * may shrink: a SIGBUS the copy raises is -EFAULT (pdhal_last_error says so), not the end
 * of the process; bytes before the fault may have been written. Each call makes sure its
 * SIGBUS handler is installed (again, if a library replaced it since), handing every other
 * SIGBUS to the handler it replaced. 0 or -errno; thread-safe. */
int pdhal_copy_guarded(void *dst, const void *src, uint64_t bytes);

/* ---- block copies (copy.c) ---- */
/* A runtime's asynchronous copy, called once per run of consecutive blocks: the ABI of
 * cudaMemcpyAsync and xpu_memcpy_async, (dst, src, bytes, kind, stream). 0 on success. */
typedef int (*pdhal_copy_fn)(void *dst, const void *src, uint64_t bytes, int kind,
                             void *stream);
/* Copy block src_ids[i] of `src` (src_blocks blocks of block_bytes) to block dst_ids[i] of
 * `dst` (dst_blocks blocks), for i < count, in order: runs where both ids step by one are
 * one copy. `copy` NULL copies at once with memmove (host memory); else each run is handed
 * to `copy` with `kind` and `stream`. Every id is checked before anything is copied:
 * -ERANGE naming the first bad one. Returns the number of copies made, or -EIO when `copy`
 * failed (its code in pdhal_last_error; runs before it were issued). */
int pdhal_copy_blocks(pdhal_copy_fn copy, int kind, void *stream, void *dst, uint64_t dst_blocks,
                      const void *src, uint64_t src_blocks, uint64_t block_bytes,
                      const int64_t *dst_ids, const int64_t *src_ids, uint64_t count);
/* pdhal_copy_blocks for the same ids in each of `layers` pairs of caches: dst[l] receives
 * from src[l], layer after layer, every cache of dst_blocks (src_blocks) blocks. The ids are
 * checked once, before anything is copied in any layer, so a bad id leaves every layer
 * unwritten. Returns the copies made in all layers (count * layers at most INT_MAX). */
int pdhal_copy_blocks_layers(pdhal_copy_fn copy, int kind, void *stream, void *const *dst,
                             uint64_t dst_blocks, const void *const *src, uint64_t src_blocks,
                             uint64_t layers, uint64_t block_bytes, const int64_t *dst_ids,
                             const int64_t *src_ids, uint64_t count);

/* ---- the copier (copier.c) ---- */
/* A thread that runs posted host copies in order, guarded (pdhal_copy_guarded), into the
 * regions of one destination mapped in this process, from the memory it may copy from. */
typedef struct pdhal_copier pdhal_copier;
/* One posted job: wait on it, then free it (the copier keeps its own reference until the
 * job ran, so a handle may be freed at any time). */
typedef struct pdhal_copy_job pdhal_copy_job;
/* One cache of a layer, as block runs expand into byte copies: block b of the source is at
 * src + b * src_stride; block b of the destination at dst_offset + b * dst_stride in region
 * `region`; block_bytes of each go. Strides equal to block_bytes on both sides make a run of
 * blocks one copy; otherwise each block is a copy of its own. */
typedef struct {
    uint64_t src;
    uint64_t src_stride;
    uint64_t region;
    uint64_t dst_offset;
    uint64_t dst_stride;
    uint64_t block_bytes;
} pdhal_copy_cache;
/* Start a copier over `regions` destination regions (region_base[i]: where region i is
 * mapped here, region_bytes[i]: its size) copying from `nsources` (address, bytes) pairs of
 * `sources`. 0 with *out set, or -errno. */
int pdhal_copier_create(const uint64_t *region_base, const uint64_t *region_bytes,
                        uint32_t regions, const uint64_t *sources, uint32_t nsources,
                        pdhal_copier **out);
/* Post `count` runs of 4 words (source address, region, offset, bytes) as one job, behind
 * those posted before. Every run is checked before anything is queued: -EINVAL (0 bytes),
 * -ERANGE (outside a region or the sources), naming the run; -ECHILD in a forked child;
 * -EPIPE once destroy began. 0 with *job set. Thread-safe. */
int pdhal_copier_post_runs(pdhal_copier *copier, const uint64_t *runs, uint64_t count,
                           pdhal_copy_job **job);
/* Post the byte copies of `nruns` block runs of 3 words (first source block, first
 * destination block, blocks) in each of `ncaches` caches, as one job, checked as
 * pdhal_copier_post_runs checks. */
int pdhal_copier_post_blocks(pdhal_copier *copier, const pdhal_copy_cache *caches,
                             uint32_t ncaches, const int64_t *block_runs, uint64_t nruns,
                             pdhal_copy_job **job);
/* Post the byte copies of `nruns` unit runs (first source unit, first destination unit,
 * units) between caches whose blocks hold different numbers of tokens, as one job: a unit
 * is the tokens both block sizes are multiples of, a source block `src_units` of them, a
 * destination block `dst_units`, a unit's id its block * units per block + its place there.
 * Each cache's block_bytes is one unit's bytes, of heads[k] KV heads, each head's part of
 * a block its tokens in order: a run becomes one copy per head per stretch inside one
 * block on both sides. Checked as pdhal_copier_post_runs checks. */
int pdhal_copier_post_units(pdhal_copier *copier, const pdhal_copy_cache *caches,
                            const uint32_t *heads, uint32_t ncaches, uint64_t src_units,
                            uint64_t dst_units, const int64_t *unit_runs, uint64_t nruns,
                            pdhal_copy_job **job);
/* orders[k] of pdhal_copier_post_pieces: the source's (destination's) blocks of cache k
 * are token-major, each token's parts in order (else head-major, each part's tokens). */
#define PDHAL_SRC_TOKEN_MAJOR 1
#define PDHAL_DST_TOKEN_MAJOR 2
/* Post the byte copies of `nruns` token runs (first source token, first destination token,
 * tokens; a token's id its block * tokens per block + its place there) between caches
 * whose blocks are ordered differently on the two sides (orders[k]), as one job: each
 * cache's block_bytes is one token's bytes, of parts[k] parts (KV heads x planes); a run
 * becomes one copy per token per part (head-major on both sides: per part per stretch,
 * as pdhal_copier_post_units). Checked as pdhal_copier_post_runs checks. */
int pdhal_copier_post_pieces(pdhal_copier *copier, const pdhal_copy_cache *caches,
                             const uint32_t *parts, const uint8_t *orders, uint32_t ncaches,
                             uint64_t src_tokens, uint64_t dst_tokens, const int64_t *token_runs,
                             uint64_t nruns, pdhal_copy_job **job);
/* Post a gate: a job that holds the copier until the per-query progress word of `signals`
 * (a PDHAL_KIND_QUERY segment, its reader's handle) reaches `until` ((step << LAYER_BITS) |
 * (layer + 1): that layer of that step signalled), so the job posted next starts at the
 * signal with no caller between (post the two under one lock of the caller's). The gate
 * fails if the word has not got there `timeout_ns` after the copier began waiting on it, if
 * it is cancelled (pdhal_copy_job_cancel), or once destroy began (before it opened); the job
 * posted next then fails too, uncopied (what it carries was never computed), unless it is a
 * gate, and the jobs after that run. A gate waiting holds up every job behind it: post
 * gated jobs to a copier of their own.
 * -EINVAL (not a per-query segment, or a timeout not above 0), -ECHILD, -EPIPE as
 * pdhal_copier_post_runs. The job holds a reference to `signals`. */
int pdhal_copier_post_gate(pdhal_copier *copier, pdhal_segment *signals, uint64_t until,
                           int64_t timeout_ns, pdhal_copy_job **job);
/* Give a gate up: unless it opened (then this does nothing), it fails, at once if the copier
 * waits on it, else when the copier reaches it, though its signal came meanwhile. Any job
 * but a gate: nothing. */
void pdhal_copy_job_cancel(pdhal_copy_job *job);
/* When a gate opened (its copier saw the signal), or a job started (CLOCK_MONOTONIC ns); 0
 * until then, and for a job that failed before it started. */
int64_t pdhal_copy_job_started_ns(pdhal_copy_job *job);
/* Wait until `job` ran, at most until deadline_ns (CLOCK_MONOTONIC, pdhal_now_ns): 0 (every
 * copy done), -EFAULT (a copy met memory its owner took away, a gate's signal never came, or
 * a gate before it failed; the detail names it), -ETIMEDOUT. */
int pdhal_copy_job_wait(pdhal_copy_job *job, int64_t deadline_ns);
/* 1 once `job` ran (done or failed), else 0: never blocks. */
int pdhal_copy_job_done(pdhal_copy_job *job);
void pdhal_copy_job_free(pdhal_copy_job *job);
/* Run every job posted, join the thread, free. Jobs' handles stay valid. NULL does nothing. */
void pdhal_copier_destroy(pdhal_copier *copier);

/* A doorbell between threads of this process: ring bumps `seq` and wakes its waiters; a
 * waiter passes the `seq` it saw before it decided to wait, so no ring is missed. Zero it to
 * start. */
typedef struct {
    uint32_t seq;
    uint32_t waiters;
} pdhal_bell;
/* Wait until `seq` is no longer `seen`, at most until deadline_ns: 0 (it moved, or a slice of
 * the wait ended: look again), -ETIMEDOUT. */
int pdhal_bell_wait(pdhal_bell *bell, uint32_t seen, int64_t deadline_ns);
void pdhal_bell_ring(pdhal_bell *bell);
/* PDHAL_CDEF_END */

#ifdef __cplusplus
}
#endif
#endif /* PDHAL_H */
