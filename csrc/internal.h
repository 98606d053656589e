/*
 * internal.h: shared-memory layouts and helpers private to the pdhal C core.
 *
 * Layout rules: fixed-width fields, magic + version + kind + size first, reserved bytes for
 * growth, offsets pinned by static_assert. Every atomic in shared memory is lock-free (checked
 * below): a non-lock-free atomic would use a process-local lock and break across processes.
 */
#ifndef PDHAL_INTERNAL_H
#define PDHAL_INTERNAL_H

#include "pdhal.h"

#include <assert.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#if ATOMIC_LLONG_LOCK_FREE != 2 || ATOMIC_INT_LOCK_FREE != 2
#error "pdhal needs lock-free 32- and 64-bit atomics for cross-process shared memory"
#endif

#define PDHAL_MAGIC 0x4745534c41484450ULL /* "PDHALSEG" little-endian */
#define PDHAL_LAYER_MASK ((UINT64_C(1) << PDHAL_LAYER_BITS) - 1)

/* The header's constants are plain numbers (cffi reads them); tie each to its definition. */
static_assert(PDHAL_MAX_LAYER == (1 << PDHAL_LAYER_BITS) - 2,
              "layer L is stored as L + 1 in the low bits, and all ones is never a layer");
static_assert(PDHAL_RECORD_WORDS == 2 + 3 * PDHAL_MAX_REQUESTS,
              "a record is count, layer, then (slot, cached, chunk) per request");
static_assert(PDHAL_QUERY_SLOT == UINT32_MAX, "the per-query slot is no ring slot");
static_assert(PDHAL_DEFAULT_RING_SLOTS >= 2, "back-pressure needs two slots at least");
/* How long one wait sleeps at most (a liveness probe and a return for signal handlers at
 * least this often): 200 ms, or PDHAL_WAIT_SLICE_MS (digits), read once (a test lengthens
 * it, so that a lost wake shows as a wait that runs to its timeout, not a slice's delay). */
int64_t pdhal_wait_slice_ns(void);
#define PDHAL_BUFFER_HEADER_BYTES 4096            /* buffer payload starts page aligned */
/* The largest buffer payload: far beyond any KV cache, and small enough that the header
 * size plus the payload cannot wrap. */
#define PDHAL_MAX_BODY_BYTES (UINT64_C(1) << 46)
#define PDHAL_MAX_RING_SLOTS 4096

/* Byte ranges of the OFD locks taken on a segment's file. */
#define PDHAL_LOCK_PRODUCER 0
#define PDHAL_LOCK_READER 1

struct pdhal_segment_header {
    /* identity: written once before the mode turns 0600, read-only afterwards */
    uint64_t magic;
    uint32_t version;
    uint32_t kind;
    uint64_t size; /* total bytes of the file */
    int32_t creator_pid;
    uint32_t creator_uid;
    uint32_t ring_slots;
    uint32_t max_requests;
    uint64_t body_bytes;
    uint8_t reserved0[16];

    /* producer side (own cache line) */
    _Atomic uint64_t progress;      /* per-query word */
    _Atomic uint32_t seq;           /* futex word: bumped on every publish */
    _Atomic uint32_t waiters;       /* readers inside futex_wait on seq */
    _Atomic uint64_t latest_step;   /* per-chunk: last table published */
    uint8_t reserved1[40];

    /* reader side (own cache line) */
    _Atomic uint64_t consumed;        /* per-chunk: steps fully delivered to the reader */
    _Atomic uint32_t reader_seq;      /* futex word: bumped when `consumed` moves */
    _Atomic uint32_t reader_waiters;  /* producers waiting for the reader (back-pressure) */
    _Atomic int32_t reader_pid;       /* last reader to attach; 0 while none ever did */
    uint8_t reserved2[108];
};
static_assert(sizeof(struct pdhal_segment_header) == 256, "header layout");
static_assert(offsetof(struct pdhal_segment_header, progress) == 64, "progress offset");
static_assert(offsetof(struct pdhal_segment_header, consumed) == 128, "consumed offset");
static_assert(offsetof(struct pdhal_segment_header, creator_pid) == 24, "pid offset");

/* One step of the per-chunk ring. `progress` doubles as a seqlock: 0 while the table is
 * being rewritten, (step << LAYER_BITS) | ready_layers once published. */
struct pdhal_ring_slot {
    _Atomic uint64_t progress;
    _Atomic uint32_t count;
    _Atomic uint32_t num_layers;
    _Atomic int32_t table[3 * PDHAL_MAX_REQUESTS];
    uint8_t reserved[48];
};
static_assert(sizeof(struct pdhal_ring_slot) % 64 == 0, "slot is whole cache lines");

struct pdhal_segment {
    struct pdhal_segment_header *hdr;
    struct pdhal_ring_slot *ring; /* NULL unless PDHAL_KIND_CHUNK */
    size_t map_bytes;
    /* The layout, copied once validated: shared memory is input, and a value re-read from
     * the header could have been changed since (to 0, or past the mapping) by another
     * process. Every index into the mapping is bounded by these. */
    uint32_t kind;
    uint32_t ring_slots;
    uint64_t body_bytes;
    int fd;             /* carries our OFD lock; -1 after close or in a forked child */
    int is_creator;
    int is_reader;      /* opened with PDHAL_OPEN_EXCLUSIVE_READER */
    pid_t pid;          /* process that opened the handle */
    _Atomic int refs;   /* the handle + pending stores */
    pthread_mutex_t publish_lock; /* per-chunk producer: one step table written at a time */
    _Atomic int reading;          /* per-chunk reader: a thread is inside a call */
    uint64_t cursor_step;  /* per-chunk reader: next record to deliver */
    uint32_t cursor_layer;
    uint64_t unacked_step; /* per-chunk reader: delivered whole, not acknowledged (0: none) */
    int64_t kernel_id;     /* kernel.c: this channel's id in kernel forms (0: none) */
    struct pdhal_segment *next_open; /* fork registry */
    char path[256];
};

/* Test-only hooks that widen race windows on purpose (tests/c/race_test.c): a build with
 * -DPDHAL_TEST_HOOKS calls pdhal_test_hook at these points; release builds compile them out. */
enum pdhal_hook_point {
    PDHAL_HOOK_WAIT_BEFORE_REGISTER, /* a waiter has read the word, is about to register */
    PDHAL_HOOK_WAKE_BETWEEN,         /* a writer between its sequence bump and waiter check */
    PDHAL_HOOK_RING_COPIED,          /* a reader has copied a table, not yet re-checked it */
    PDHAL_HOOK_READ_SEQ,             /* a waiter has read the sequence, not yet the progress */
    PDHAL_HOOK_PUBLISHED,            /* a writer has stored progress, not yet bumped the seq */
    PDHAL_HOOK_STEP_READ,            /* a step start has read the word, not yet written it */
};
#ifdef PDHAL_TEST_HOOKS
extern void (*pdhal_test_hook)(enum pdhal_hook_point point);
#define PDHAL_HOOK(point)                                                                       \
    do {                                                                                         \
        if (pdhal_test_hook)                                                                     \
            pdhal_test_hook(point);                                                              \
    } while (0)
#else
#define PDHAL_HOOK(point) ((void)0)
#endif

/* errors.c */
int pdhal_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* wait.c */
int64_t pdhal_deadline_slice(int64_t deadline_ns);
/* What a blocking call returns for a pdhal_wait_change result other than 0 and -ETIMEDOUT
 * (whose meaning is the caller's): -EINTR, or the futex's error, with the detail set. */
int pdhal_wait_failed(int rc, const char *path);
int pdhal_futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t deadline_ns);
void pdhal_futex_wake_all(_Atomic uint32_t *word);
/* Wait for `*word` to move away from `seen`, for at most one slice before `deadline_ns`:
 * 0 (moved or woken), -ETIMEDOUT (deadline passed), -EINTR (a signal, or the slice ended). */
int pdhal_wait_change(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t seen,
                      int64_t deadline_ns);
void pdhal_bump_and_wake(_Atomic uint32_t *word, _Atomic uint32_t *waiters);

/* progress.c */
extern pdhal_store pdhal_noop_store;

/* kernel.c */
void pdhal_kernel_forget_channel(pdhal_segment *seg);
void pdhal_kernel_register_sender(pdhal_sender *sender, int64_t *id);
void pdhal_kernel_forget_sender(pdhal_sender *sender, int64_t id);

/* worker.c: a thread taking queued items in posting order (the sender's, the copier's). An
 * item's first member is a pdhal_work. */
struct pdhal_work {
    struct pdhal_work *next;
};
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    struct pdhal_work *head, *tail; /* guarded by lock */
    int stopping;                   /* guarded by lock */
    pthread_t thread;
    pid_t pid; /* the thread exists only in this process, not in a forked child */
} pdhal_worker;
/* Start main(arg) on a thread with every signal blocked but the faults it may raise itself
 * (SIGBUS, SIGSEGV, SIGFPE, SIGILL): 0, or pthread_create's error (nothing to stop then). */
int pdhal_worker_start(pdhal_worker *w, void *(*main)(void *), void *arg);
/* On the thread: the next item, waiting for one; NULL once stopping and none is left. */
struct pdhal_work *pdhal_worker_take(pdhal_worker *w);
/* Queue `item` behind those put before it: 0, or -EPIPE once stopping began. */
int pdhal_worker_put(pdhal_worker *w, struct pdhal_work *item);
/* Stop: the thread takes every item queued, then it is joined; NULL. In a forked child (no
 * thread there) nothing is joined and the items never taken are returned, the caller's to
 * free. */
struct pdhal_work *pdhal_worker_stop(pdhal_worker *w);

/* fault.c: pdhal_copy_guarded in two steps, for a thread that copies many times in a row:
 * arm once (0, or -errno: no handler, so copy nothing), then each copy. */
int pdhal_guard_arm(void);
int pdhal_copy_armed(void *dst, const void *src, uint64_t bytes);
/* Copies laid out in rows: copy j of row i moves `bytes` from src + i * src_row + j *
 * src_step to dst + i * dst_row + j * dst_step (j < count, i < rows). */
struct pdhal_grid {
    uint64_t bytes, count, dst_step, src_step, rows, dst_row, src_row;
};
/* Every copy of `grid`, rows in order, under one guard. */
int pdhal_copy_armed_grid(void *dst, const void *src, const struct pdhal_grid *grid);
/* A grid's copies from src to dst. */
struct pdhal_placed_grid {
    char *dst;
    const char *src;
    struct pdhal_grid grid;
};
/* `n` grids of one row of `count` copies each, every one's source starting where the one
 * before it ends (the stretches of one prefill block, a copy per head each): copy j of
 * every grid, then copy j + 1 of every grid, under one guard, so each head's part of the
 * source is read in order. */
int pdhal_copy_armed_columns(const struct pdhal_placed_grid *grids, uint64_t n);

/* segment.c */
void pdhal_segment_ref(pdhal_segment *seg);
void pdhal_segment_unref(pdhal_segment *seg);
/* 0 while the producer lives; -EOWNERDEAD (with the detail set) once it died; -errno. */
int pdhal_segment_require_producer(pdhal_segment *seg);

#endif /* PDHAL_INTERNAL_H */
