/* copier.c: host copies into another process's mapped memory, run in order on a thread of
 * the copier's own, with no Python and no GIL.
 *
 * The shm transport's link owns one copier per decode side it maps. A post checks every copy
 * against what the copier was created with (the destination's regions, the memory it may
 * copy from) before it queues anything, so a bad run fails the post, never a later copy; the
 * thread then runs each job's copies guarded (a SIGBUS from a peer that shrank its file fails
 * that job, not the process) and marks the job done, waking whoever waits on it. A post of
 * block runs expands them into byte copies here, cache by cache, so a layer of a step costs
 * the caller one call however many runs it has.
 *
 * A gate is a job that holds the thread until a layer's signal (the engine's per-query
 * progress word) is published: the jobs posted behind it start at the signal, woken by its
 * futex, with nothing of the poster's in between. A gate whose signal does not come within
 * its timeout, that is cancelled, or that destroy interrupts fails, and so does the one job
 * posted right after it unless that is a gate too (the copies it guards, which were never
 * computed), uncopied; the jobs after that run as they would have. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { JOB_PENDING = 0, JOB_DONE = 1, JOB_FAILED = 2 };

struct pdhal_copy_job {
    struct pdhal_work work; /* first: the worker's queue links it */
    _Atomic uint32_t state; /* futex word: JOB_PENDING until the thread ran it */
    _Atomic int refs;       /* the poster's handle and the queue's */
    char why[256];          /* a failed job's reason, written before state */
    _Atomic int64_t started_ns; /* when it started (a gate: opened); 0 until then */
    _Atomic int cancelled;      /* a gate given up (pdhal_copy_job_cancel) */
    pdhal_segment *gate;        /* a gate's signals (holding a reference); NULL: copies */
    uint64_t until;             /* a gate's progress word to wait for */
    int64_t timeout_ns;         /* a gate's longest wait, from when the thread reaches it */
    uint64_t count;
    struct pdhal_placed_grid copies[]; /* one copy, or rows of them */
};

struct span { uint64_t start, end; };

struct pdhal_copier {
    pdhal_worker worker; /* its thread and queue of jobs */
    /* The gate the thread waits on (NULL: none), for destroy to wake: set and cleared by the
     * thread, read by destroy, under gate_lock (the segment lives while it is set). */
    pthread_mutex_t gate_lock;
    pdhal_segment *waiting;
    _Atomic int closing;  /* destroy began: a gate waiting fails */
    char skip[200];       /* the thread's own: why the job after a failed gate fails ("") */
    uint32_t regions;
    uint64_t *region_base, *region_bytes;
    uint32_t nsources;
    struct span *sources; /* sorted by start */
};

static void job_unref(struct pdhal_copy_job *job)
{
    if (job && atomic_fetch_sub_explicit(&job->refs, 1, memory_order_acq_rel) == 1) {
        if (job->gate)
            pdhal_segment_unref(job->gate);
        free(job);
    }
}

/* Wait until `gate`'s signal came (0), its timeout passed, or destroy began (-errno, the
 * detail set). */
static int open_gate(pdhal_copier *c, struct pdhal_copy_job *gate)
{
    pdhal_segment *seg = gate->gate;
    struct pdhal_segment_header *h = seg->hdr;
    int64_t now = pdhal_now_ns();
    int64_t deadline = gate->timeout_ns > INT64_MAX - now ? INT64_MAX : now + gate->timeout_ns;
    uint64_t step = gate->until >> PDHAL_LAYER_BITS;
    long long layer = (long long)(gate->until & PDHAL_LAYER_MASK) - 1;
    pthread_mutex_lock(&c->gate_lock);
    c->waiting = seg;
    pthread_mutex_unlock(&c->gate_lock);
    int rc;
    for (;;) {
        /* acquire: the progress read next is at least as new as this sequence value */
        uint32_t seen = atomic_load_explicit(&h->seq, memory_order_acquire);
        /* after the sequence read: destroy (cancel) sets closing (cancelled), then bumps
         * the sequence; and before the progress: a gate given up stays given up, though
         * its signal came while it waited its turn */
        if (atomic_load(&c->closing)) {
            rc = pdhal_fail(ECANCELED, "the link closed before layer %lld of step %llu was "
                                       "signalled", layer, (unsigned long long)step);
            break;
        }
        if (atomic_load(&gate->cancelled)) {
            rc = pdhal_fail(ECANCELED, "given up before layer %lld of step %llu was copied",
                            layer, (unsigned long long)step);
            break;
        }
        if (pdhal_progress_load(seg) >= gate->until) {
            rc = 0;
            break;
        }
        rc = pdhal_wait_change(&h->seq, &h->waiters, seen, deadline);
        if (rc == -ETIMEDOUT) {
            rc = pdhal_fail(ETIMEDOUT, "layer %lld of step %llu was not signalled on %s within "
                                       "%.3g s", layer, (unsigned long long)step, seg->path,
                            (double)gate->timeout_ns / 1e9);
            break;
        }
        if (rc < 0 && rc != -EINTR) {
            rc = pdhal_wait_failed(rc, seg->path);
            break;
        }
    }
    pthread_mutex_lock(&c->gate_lock);
    c->waiting = NULL;
    pthread_mutex_unlock(&c->gate_lock);
    return rc;
}

/* How many of the `left` grids from `first` on are one row of as many copies each, every
 * one's source starting where the one before it ends: run as columns, they read the source
 * in order (a prefill block's stretches into decode blocks of another size, a copy per head
 * each, would otherwise read every head's part a stretch at a time). */
static uint64_t columns(const struct pdhal_placed_grid *first, uint64_t left)
{
    uint64_t n = 1;
    if (first->grid.rows != 1 || first->grid.count < 2)
        return n;
    for (const struct pdhal_placed_grid *g = first; n < left; n++, g++) {
        const struct pdhal_placed_grid *next = g + 1;
        if (next->grid.rows != 1 || next->grid.count != first->grid.count ||
            next->src != g->src + g->grid.bytes)
            break;
    }
    return n;
}

/* Run `job`: a gate opens, copies copy. Returns its state, the reason in job->why. */
static uint32_t run_job(pdhal_copier *c, struct pdhal_copy_job *job)
{
    if (job->gate) {
        c->skip[0] = '\0'; /* a gate guards no gate: one that guarded nothing is done with */
        if (open_gate(c, job) != 0) {
            snprintf(c->skip, sizeof c->skip, "%s", pdhal_last_error());
            snprintf(job->why, sizeof job->why, "%s", c->skip);
            return JOB_FAILED;
        }
        atomic_store_explicit(&job->started_ns, pdhal_now_ns(), memory_order_relaxed);
        return JOB_DONE;
    }
    if (c->skip[0]) { /* the copies a failed gate guarded */
        snprintf(job->why, sizeof job->why, "not copied: %s", c->skip);
        c->skip[0] = '\0';
        return JOB_FAILED;
    }
    atomic_store_explicit(&job->started_ns, pdhal_now_ns(), memory_order_relaxed);
    if (pdhal_guard_arm() != 0) { /* no handler: no copy may run unguarded */
        snprintf(job->why, sizeof job->why, "%s", pdhal_last_error());
        return JOB_FAILED;
    }
    for (uint64_t i = 0, n; i < job->count; i += n) {
        const struct pdhal_placed_grid *copy = &job->copies[i];
        n = columns(copy, job->count - i);
        if ((n > 1 ? pdhal_copy_armed_columns(copy, n)
                   : pdhal_copy_armed_grid(copy->dst, copy->src, &copy->grid)) != 0) {
            snprintf(job->why, sizeof job->why, "copy %llu of %llu: %s", (unsigned long long)i,
                     (unsigned long long)job->count, pdhal_last_error());
            return JOB_FAILED;
        }
    }
    return JOB_DONE;
}

static void *copier_main(void *arg)
{
    pdhal_copier *c = arg;
    for (;;) {
        struct pdhal_copy_job *job = (struct pdhal_copy_job *)pdhal_worker_take(&c->worker);
        if (!job)
            return NULL; /* stopping, and every job ran */
        uint32_t state = run_job(c, job);
        /* release: a waiter that sees the state also sees the bytes and the reason */
        atomic_store_explicit(&job->state, state, memory_order_release);
        pdhal_futex_wake_all(&job->state);
        job_unref(job);
    }
}

static int compare_spans(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

int pdhal_copier_create(const uint64_t *region_base, const uint64_t *region_bytes,
                        uint32_t regions, const uint64_t *sources, uint32_t nsources,
                        pdhal_copier **out)
{
    *out = NULL;
    if ((regions && (!region_base || !region_bytes)) || (nsources && !sources))
        return pdhal_fail(EINVAL, "a copier needs its regions' bases and sizes and its "
                                  "sources' (address, bytes) pairs");
    for (uint32_t i = 0; i < regions; i++) {
        if (region_base[i] > UINT64_MAX - region_bytes[i])
            return pdhal_fail(EINVAL, "region %u (%llu bytes at %#llx) wraps the address "
                                      "space", i, (unsigned long long)region_bytes[i],
                              (unsigned long long)region_base[i]);
    }
    pdhal_copier *c = calloc(1, sizeof *c);
    uint64_t *bases = calloc(regions ? regions : 1, sizeof *bases);
    uint64_t *sizes = calloc(regions ? regions : 1, sizeof *sizes);
    struct span *spans = calloc(nsources ? nsources : 1, sizeof *spans);
    if (!c || !bases || !sizes || !spans) {
        free(c), free(bases), free(sizes), free(spans);
        return pdhal_fail(ENOMEM, "out of memory");
    }
    memcpy(bases, region_base, regions * sizeof *bases);
    memcpy(sizes, region_bytes, regions * sizeof *sizes);
    for (uint32_t i = 0; i < nsources; i++) {
        uint64_t start = sources[2 * i], bytes = sources[2 * i + 1];
        spans[i].start = start;
        spans[i].end = start > UINT64_MAX - bytes ? UINT64_MAX : start + bytes;
    }
    qsort(spans, nsources, sizeof *spans, compare_spans);
    pthread_mutex_init(&c->gate_lock, NULL);
    c->regions = regions, c->region_base = bases, c->region_bytes = sizes;
    c->nsources = nsources, c->sources = spans;
    /* every signal blocked on the copier thread but SIGBUS, a guarded copy's own fault */
    int rc = pdhal_worker_start(&c->worker, copier_main, c);
    if (rc != 0) {
        pthread_mutex_destroy(&c->gate_lock);
        free(bases), free(sizes), free(spans), free(c);
        return pdhal_fail(rc, "cannot start the copier thread: %s", strerror(rc));
    }
    *out = c;
    return 0;
}

/* Whether [src, src + bytes) lies inside one source span. */
static int from_sources(const pdhal_copier *c, uint64_t src, uint64_t bytes)
{
    uint32_t low = 0, high = c->nsources; /* the last span starting at or before src */
    while (low < high) {
        uint32_t mid = low + (high - low) / 2;
        if (c->sources[mid].start <= src)
            low = mid + 1;
        else
            high = mid;
    }
    if (low == 0)
        return 0;
    const struct span *s = &c->sources[low - 1];
    return src <= s->end && bytes <= s->end - src;
}

/* Entry `at` of `job` (the copy of run `index`): `grid`'s copies from `src` into region
 * `region` at `offset`, checked whole (every step is forward: from the first copy's start
 * to the last one's end inside the region and inside the sources); -ERANGE naming what is
 * outside. */
static int add_grid(const pdhal_copier *c, struct pdhal_copy_job *job, uint64_t at,
                    uint64_t index, uint64_t src, uint64_t region, uint64_t offset,
                    const struct pdhal_grid *grid)
{
    uint64_t bytes = grid->bytes;
    if (bytes == 0 || grid->count == 0 || grid->rows == 0)
        return pdhal_fail(EINVAL, "run %llu copies 0 bytes (at least 1 is a run)",
                          (unsigned long long)index);
    /* the span from the first copy's start to the last one's end: below 2^128 */
    __uint128_t dst_span = (__uint128_t)(grid->rows - 1) * grid->dst_row +
                           (__uint128_t)(grid->count - 1) * grid->dst_step + bytes;
    __uint128_t src_span = (__uint128_t)(grid->rows - 1) * grid->src_row +
                           (__uint128_t)(grid->count - 1) * grid->src_step + bytes;
    if (region >= c->regions || offset > c->region_bytes[region] ||
        dst_span > c->region_bytes[region] - offset)
        return pdhal_fail(ERANGE, "run %llu, of %llu bytes at offset %llu of region %llu, is "
                                  "outside the destination (%u regions)",
                          (unsigned long long)index, (unsigned long long)bytes,
                          (unsigned long long)offset, (unsigned long long)region, c->regions);
    if (src_span > UINT64_MAX || !from_sources(c, src, (uint64_t)src_span))
        return pdhal_fail(ERANGE, "run %llu's source [%#llx, +%llu) is outside the memory "
                                  "this link was given to copy from",
                          (unsigned long long)index, (unsigned long long)src,
                          (unsigned long long)bytes);
    job->copies[at] = (struct pdhal_placed_grid){
        .dst = (char *)(uintptr_t)(c->region_base[region] + offset),
        .src = (const char *)(uintptr_t)src,
        .grid = *grid,
    };
    return 0;
}

static int add_copy(const pdhal_copier *c, struct pdhal_copy_job *job, uint64_t at,
                    uint64_t index, uint64_t src, uint64_t region, uint64_t offset,
                    uint64_t bytes)
{
    struct pdhal_grid grid = {.bytes = bytes, .count = 1, .rows = 1};
    return add_grid(c, job, at, index, src, region, offset, &grid);
}

static int new_job(uint64_t count, struct pdhal_copy_job **out)
{
    if (count > (SIZE_MAX - sizeof(struct pdhal_copy_job)) / sizeof(struct pdhal_placed_grid))
        return pdhal_fail(EINVAL, "%llu copies in one post", (unsigned long long)count);
    struct pdhal_copy_job *job = malloc(sizeof *job + count * sizeof(struct pdhal_placed_grid));
    if (!job)
        return pdhal_fail(ENOMEM, "out of memory");
    atomic_init(&job->state, JOB_PENDING);
    atomic_init(&job->refs, 2);
    atomic_init(&job->started_ns, 0);
    atomic_init(&job->cancelled, 0);
    job->why[0] = '\0';
    job->gate = NULL;
    job->count = count;
    *out = job;
    return 0;
}

/* Queue `job` (its copies checked), or fail it whole: -ECHILD in a forked child, -EPIPE once
 * the copier stops. */
static int enqueue(pdhal_copier *c, struct pdhal_copy_job *job, pdhal_copy_job **out)
{
    if (c->worker.pid != getpid()) {
        job_unref(job), job_unref(job); /* both of its references: it was never queued */
        return pdhal_fail(ECHILD, "this copier belongs to pid %d; a forked child must "
                                  "connect its own link", (int)c->worker.pid);
    }
    if (pdhal_worker_put(&c->worker, &job->work) != 0) {
        job_unref(job), job_unref(job);
        return pdhal_fail(EPIPE, "the copier was stopped (its link closed)");
    }
    *out = job;
    return 0;
}

int pdhal_copier_post_gate(pdhal_copier *c, pdhal_segment *signals, uint64_t until,
                           int64_t timeout_ns, pdhal_copy_job **out)
{
    *out = NULL;
    if (!signals || signals->kind != PDHAL_KIND_QUERY)
        return pdhal_fail(EINVAL, "a gate waits on a per-query channel's progress word");
    if (timeout_ns <= 0)
        return pdhal_fail(EINVAL, "a gate's timeout is %lld ns: above 0", (long long)timeout_ns);
    struct pdhal_copy_job *job = NULL;
    int failed = new_job(0, &job);
    if (failed)
        return failed;
    pdhal_segment_ref(signals);
    job->gate = signals, job->until = until, job->timeout_ns = timeout_ns;
    return enqueue(c, job, out);
}

int pdhal_copier_post_runs(pdhal_copier *c, const uint64_t *runs, uint64_t count,
                           pdhal_copy_job **out)
{
    *out = NULL;
    if (count && !runs)
        return pdhal_fail(EINVAL, "no runs to post");
    struct pdhal_copy_job *job = NULL;
    int failed = new_job(count, &job);
    if (failed)
        return failed;
    for (uint64_t i = 0; i < count; i++) {
        const uint64_t *run = runs + 4 * i;
        int rc = add_copy(c, job, i, i, run[0], run[1], run[2], run[3]);
        if (rc) {
            free(job);
            return rc;
        }
    }
    return enqueue(c, job, out);
}

int pdhal_copier_post_blocks(pdhal_copier *c, const pdhal_copy_cache *caches, uint32_t ncaches,
                             const int64_t *block_runs, uint64_t nruns, pdhal_copy_job **out)
{
    *out = NULL;
    if ((ncaches && !caches) || (nruns && !block_runs))
        return pdhal_fail(EINVAL, "no caches or block runs to post");
    uint64_t count = 0; /* the byte copies they expand to */
    for (uint32_t k = 0; k < ncaches; k++) {
        const pdhal_copy_cache *cache = &caches[k];
        if (cache->block_bytes == 0 || cache->region >= c->regions)
            return pdhal_fail(ERANGE, "cache %u has blocks of %llu bytes in region %llu: "
                                      "outside the destination (%u regions)",
                              k, (unsigned long long)cache->block_bytes,
                              (unsigned long long)cache->region, c->regions);
        int whole = cache->src_stride == cache->block_bytes &&
                    cache->dst_stride == cache->block_bytes;
        /* more blocks in one run than its region holds cannot all be inside it: refused
         * here, before their copies are counted (or n * block_bytes could wrap) */
        uint64_t most = c->region_bytes[cache->region] / cache->block_bytes;
        for (uint64_t r = 0; r < nruns; r++) {
            int64_t blocks = block_runs[3 * r + 2];
            if (block_runs[3 * r] < 0 || block_runs[3 * r + 1] < 0 || blocks < 1 ||
                blocks > (int64_t)1 << 40)
                return pdhal_fail(EINVAL, "block run %llu is (%lld, %lld, %lld): ids from 0, "
                                          "at least one block",
                                  (unsigned long long)r, (long long)block_runs[3 * r],
                                  (long long)block_runs[3 * r + 1], (long long)blocks);
            if ((uint64_t)blocks > most)
                return pdhal_fail(ERANGE, "block run %llu of cache %u, %lld blocks of %llu "
                                          "bytes, is outside the destination (region %llu "
                                          "holds %llu bytes)",
                                  (unsigned long long)r, k, (long long)blocks,
                                  (unsigned long long)cache->block_bytes,
                                  (unsigned long long)cache->region,
                                  (unsigned long long)c->region_bytes[cache->region]);
            count += whole ? 1 : (uint64_t)blocks;
        }
    }
    struct pdhal_copy_job *job = NULL;
    int failed = new_job(count, &job);
    if (failed)
        return failed;
    /* Block by block, each block's caches in their order (the planner's: the destination's,
     * so a block whose heads keep their K and V together is written in order); a cache of
     * whole blocks on both sides is one copy per run, at the run's first block. */
    uint64_t at = 0;
    for (uint64_t r = 0; r < nruns; r++) {
        uint64_t s = (uint64_t)block_runs[3 * r], d = (uint64_t)block_runs[3 * r + 1];
        uint64_t n = (uint64_t)block_runs[3 * r + 2];
        for (uint64_t i = 0; i < n; i++) {
            for (uint32_t k = 0; k < ncaches; k++) {
                const pdhal_copy_cache *cache = &caches[k];
                int whole = cache->src_stride == cache->block_bytes &&
                            cache->dst_stride == cache->block_bytes;
                if (whole && i > 0)
                    continue;
                /* ids below 2^40 and strides below 2^64 / 2^41 keep these from wrapping;
                 * a stride past that is refused as out of range by add_copy's checks */
                __uint128_t src = (__uint128_t)cache->src + (__uint128_t)(s + i) * cache->src_stride;
                __uint128_t off = (__uint128_t)cache->dst_offset +
                                  (__uint128_t)(d + i) * cache->dst_stride;
                uint64_t bytes = whole ? n * cache->block_bytes : cache->block_bytes;
                int rc = src > UINT64_MAX || off > UINT64_MAX
                             ? pdhal_fail(ERANGE, "block run %llu of cache %u lies past the "
                                                  "address space", (unsigned long long)r, k)
                             : add_copy(c, job, at, at, (uint64_t)src, cache->region,
                                        (uint64_t)off, bytes);
                if (rc) {
                    free(job);
                    return rc;
                }
                at++;
            }
        }
    }
    return enqueue(c, job, out);
}

/* Each stretch of run `r` inside one block on both sides: calls `each` with its first
 * source and destination units and its length, until it returns non-zero. */
static int stretches(const int64_t *run, uint64_t src_units, uint64_t dst_units,
                     int (*each)(void *, uint64_t, uint64_t, uint64_t), void *arg)
{
    uint64_t s = (uint64_t)run[0], d = (uint64_t)run[1], n = (uint64_t)run[2];
    while (n) {
        uint64_t k = n, left = src_units - s % src_units, right = dst_units - d % dst_units;
        k = k < left ? k : left;
        k = k < right ? k : right;
        int rc = each(arg, s, d, k);
        if (rc)
            return rc;
        s += k, d += k, n -= k;
    }
    return 0;
}

struct unit_post {
    const pdhal_copier *c;
    const pdhal_copy_cache *cache;
    uint32_t cache_index, heads;
    uint8_t order; /* PDHAL_SRC_TOKEN_MAJOR | PDHAL_DST_TOKEN_MAJOR */
    uint64_t src_units, dst_units, run, count, at;
    struct pdhal_copy_job *job; /* NULL: only count the copies */
};

/* Where unit u of the first part is in a block of `parts` parts, in units: a head-major
 * block keeps a part's units together, a token-major one a unit's parts. */
static __uint128_t unit_place(int token_major, uint64_t u, uint32_t parts)
{
    return token_major ? (__uint128_t)u * parts : u;
}

static int unit_copies(void *arg, uint64_t s, uint64_t d, uint64_t k)
{
    struct unit_post *p = arg;
    if (!p->job) {
        p->count++; /* a stretch is one entry */
        return 0;
    }
    const uint8_t both = PDHAL_SRC_TOKEN_MAJOR | PDHAL_DST_TOKEN_MAJOR;
    uint32_t parts = p->order == both ? 1 : p->heads;
    const pdhal_copy_cache *cache = p->cache;
    uint64_t unit = cache->block_bytes / parts; /* of one part (of every part: both) */
    /* Each part's k units in a row: one copy of them per part (head-major on both sides),
     * one of every part's (token-major on both); between two orders, a copy per unit and
     * part, rows of them in the destination's order (its side the contiguous one). */
    struct pdhal_grid grid = {.bytes = k * unit, .count = parts, .rows = 1};
    if (p->order == both) {
        grid.count = 1;
    } else if (!p->order) {
        grid.dst_step = p->dst_units * unit, grid.src_step = p->src_units * unit;
    } else if (p->order == PDHAL_SRC_TOKEN_MAJOR) { /* a row per part: its k units */
        grid = (struct pdhal_grid){.bytes = unit, .count = k, .dst_step = unit,
                                   .src_step = parts * unit, .rows = parts,
                                   .dst_row = p->dst_units * unit, .src_row = unit};
    } else { /* a row per unit: its parts */
        grid = (struct pdhal_grid){.bytes = unit, .count = parts, .dst_step = unit,
                                   .src_step = p->src_units * unit, .rows = k,
                                   .dst_row = parts * unit, .src_row = unit};
    }
    /* ids below 2^40 x 2^24 units, bytes below 2^64: no product wraps 128 bits */
    __uint128_t src =
        (__uint128_t)cache->src + (__uint128_t)(s / p->src_units) * cache->src_stride +
        unit_place(p->order & PDHAL_SRC_TOKEN_MAJOR, s % p->src_units, parts) *
            unit;
    __uint128_t off =
        (__uint128_t)cache->dst_offset + (__uint128_t)(d / p->dst_units) * cache->dst_stride +
        unit_place(p->order & PDHAL_DST_TOKEN_MAJOR, d % p->dst_units, parts) *
            unit;
    if (src > UINT64_MAX || off > UINT64_MAX)
        return pdhal_fail(ERANGE, "unit run %llu of cache %u lies past the address space",
                          (unsigned long long)p->run, p->cache_index);
    int rc = add_grid(p->c, p->job, p->at, p->at, (uint64_t)src, cache->region, (uint64_t)off,
                      &grid);
    p->at++;
    return rc;
}

static int post_units(pdhal_copier *c, const pdhal_copy_cache *caches, const uint32_t *heads,
                      const uint8_t *orders, uint32_t ncaches, uint64_t src_units,
                      uint64_t dst_units, const int64_t *unit_runs, uint64_t nruns,
                      pdhal_copy_job **out);

int pdhal_copier_post_units(pdhal_copier *c, const pdhal_copy_cache *caches,
                            const uint32_t *heads, uint32_t ncaches, uint64_t src_units,
                            uint64_t dst_units, const int64_t *unit_runs, uint64_t nruns,
                            pdhal_copy_job **out)
{
    return post_units(c, caches, heads, NULL, ncaches, src_units, dst_units, unit_runs, nruns,
                      out);
}

int pdhal_copier_post_pieces(pdhal_copier *c, const pdhal_copy_cache *caches,
                             const uint32_t *parts, const uint8_t *orders, uint32_t ncaches,
                             uint64_t src_tokens, uint64_t dst_tokens, const int64_t *token_runs,
                             uint64_t nruns, pdhal_copy_job **out)
{
    *out = NULL;
    if (ncaches && !orders)
        return pdhal_fail(EINVAL, "no orders to post pieces by");
    for (uint32_t k = 0; k < ncaches; k++)
        if (orders[k] & ~(PDHAL_SRC_TOKEN_MAJOR | PDHAL_DST_TOKEN_MAJOR))
            return pdhal_fail(EINVAL, "cache %u's order is %u: a mask of "
                                      "PDHAL_SRC_TOKEN_MAJOR and PDHAL_DST_TOKEN_MAJOR",
                              k, orders[k]);
    return post_units(c, caches, parts, orders, ncaches, src_tokens, dst_tokens, token_runs,
                      nruns, out);
}

static int post_units(pdhal_copier *c, const pdhal_copy_cache *caches, const uint32_t *heads,
                      const uint8_t *orders, uint32_t ncaches, uint64_t src_units,
                      uint64_t dst_units, const int64_t *unit_runs, uint64_t nruns,
                      pdhal_copy_job **out)
{
    *out = NULL;
    if ((ncaches && (!caches || !heads)) || (nruns && !unit_runs))
        return pdhal_fail(EINVAL, "no caches, heads or unit runs to post");
    if (src_units < 1 || dst_units < 1 || src_units > 1 << 24 || dst_units > 1 << 24)
        return pdhal_fail(EINVAL, "blocks of %llu and %llu units: each from 1 to 2^24",
                          (unsigned long long)src_units, (unsigned long long)dst_units);
    struct unit_post post = {.c = c, .src_units = src_units, .dst_units = dst_units};
    for (uint32_t k = 0; k < ncaches; k++) {
        const pdhal_copy_cache *cache = &caches[k];
        if (heads[k] < 1 || cache->block_bytes == 0 || cache->block_bytes % heads[k] ||
            cache->region >= c->regions)
            return pdhal_fail(ERANGE, "cache %u has units of %llu bytes of %u heads in region "
                                      "%llu: not whole heads, or outside the destination (%u "
                                      "regions)",
                              k, (unsigned long long)cache->block_bytes, heads[k],
                              (unsigned long long)cache->region, c->regions);
        uint64_t most = c->region_bytes[cache->region] / cache->block_bytes;
        for (uint64_t r = 0; r < nruns; r++) {
            const int64_t *run = unit_runs + 3 * r;
            if (run[0] < 0 || run[1] < 0 || run[2] < 1 || run[0] > (int64_t)1 << 62 ||
                run[1] > (int64_t)1 << 62 || (uint64_t)run[2] > most)
                return pdhal_fail(ERANGE, "unit run %llu is (%lld, %lld, %lld): ids from 0, "
                                          "at least one unit, no more than region %llu "
                                          "holds (%llu)",
                                  (unsigned long long)r, (long long)run[0], (long long)run[1],
                                  (long long)run[2], (unsigned long long)cache->region,
                                  (unsigned long long)most);
            post.heads = heads[k], post.order = orders ? orders[k] : 0;
            stretches(run, src_units, dst_units, unit_copies, &post);
        }
    }
    struct pdhal_copy_job *job = NULL;
    int failed = new_job(post.count, &job);
    if (failed)
        return failed;
    post.job = job;
    for (uint32_t k = 0; k < ncaches; k++) {
        post.cache = &caches[k], post.cache_index = k, post.heads = heads[k];
        post.order = orders ? orders[k] : 0;
        for (uint64_t r = 0; r < nruns; r++) {
            post.run = r;
            int rc = stretches(unit_runs + 3 * r, src_units, dst_units, unit_copies, &post);
            if (rc) {
                free(job);
                return rc;
            }
        }
    }
    return enqueue(c, job, out);
}

int pdhal_copy_job_wait(pdhal_copy_job *job, int64_t deadline_ns)
{
    for (;;) {
        uint32_t state = atomic_load_explicit(&job->state, memory_order_acquire);
        if (state == JOB_DONE)
            return 0;
        if (state == JOB_FAILED)
            return pdhal_fail(EFAULT, "%s", job->why);
        int rc = pdhal_futex_wait(&job->state, JOB_PENDING, deadline_ns);
        if (rc == -ETIMEDOUT && atomic_load_explicit(&job->state, memory_order_acquire) ==
                                    JOB_PENDING)
            return -ETIMEDOUT;
        /* 0 (woken, or the state moved) and -EINTR look again */
    }
}

void pdhal_copy_job_cancel(pdhal_copy_job *job)
{
    if (!job->gate)
        return;
    atomic_store(&job->cancelled, 1); /* then the wake: a gate waiting sees it (open_gate) */
    pdhal_bump_and_wake(&job->gate->hdr->seq, &job->gate->hdr->waiters);
}

int64_t pdhal_copy_job_started_ns(pdhal_copy_job *job)
{
    return atomic_load_explicit(&job->started_ns, memory_order_relaxed);
}

int pdhal_copy_job_done(pdhal_copy_job *job)
{
    return atomic_load_explicit(&job->state, memory_order_acquire) != JOB_PENDING;
}

void pdhal_copy_job_free(pdhal_copy_job *job) { job_unref(job); }

void pdhal_copier_destroy(pdhal_copier *c)
{
    if (!c)
        return;
    /* Every job queued runs first; inherited across fork, the thread does not exist here:
     * the jobs queued never ran in this process, and their waiters (if any) are this
     * process's to time out. */
    if (c->worker.pid == getpid()) { /* (in a forked child, no thread waits; the lock may
                                       * have been copied held) */
        atomic_store(&c->closing, 1); /* then the wake: a gate waiting sees it (open_gate) */
        pthread_mutex_lock(&c->gate_lock);
        if (c->waiting)
            pdhal_bump_and_wake(&c->waiting->hdr->seq, &c->waiting->hdr->waiters);
        pthread_mutex_unlock(&c->gate_lock);
    }
    for (struct pdhal_work *w = pdhal_worker_stop(&c->worker), *next; w; w = next) {
        next = w->next;
        job_unref((struct pdhal_copy_job *)w);
    }
    if (c->worker.pid == getpid())
        pthread_mutex_destroy(&c->gate_lock);
    free(c->region_base), free(c->region_bytes), free(c->sources), free(c);
}

/* A doorbell: a 32-bit word bumped by ring, waited on by a thread that saw its value. */
int pdhal_bell_wait(pdhal_bell *bell, uint32_t seen, int64_t deadline_ns)
{
    int rc = pdhal_wait_change((_Atomic uint32_t *)&bell->seq, (_Atomic uint32_t *)&bell->waiters,
                               seen, deadline_ns);
    return rc == -EINTR ? 0 : rc; /* a slice's end or a signal: the caller looks again */
}

void pdhal_bell_ring(pdhal_bell *bell)
{
    pdhal_bump_and_wake((_Atomic uint32_t *)&bell->seq, (_Atomic uint32_t *)&bell->waiters);
}
