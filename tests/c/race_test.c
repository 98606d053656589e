/* race_test.c: memory-ordering and lost-wake checks of the C core, two threads in one
 * process (a producer handle and a reader handle on the same segment).
 *
 * Built from csrc/ with -DPDHAL_TEST_HOOKS (tests/protocol/test_races.py), and with
 * -fsanitize=thread by `make tsan`:
 *
 *   lost_wake        forces the interleaving in which a writer that looked for waiters
 *                    before bumping the sequence word would leave a reader asleep: the
 *                    reader must see the publish at once, not at the end of its 200 ms slice.
 *   query_payload    a writer fills a plain (non-atomic) buffer, then publishes the layer;
 *                    the reader waits and reads the buffer. Under ThreadSanitizer a publish
 *                    that is not a release (or a load that is not an acquire) is a data race
 *                    on the buffer. The first layer is forced through the one interleaving
 *                    where nothing else orders it (the reader read the sequence word before
 *                    the writer's bump, and the progress after its store), so the race is
 *                    reported every run, not only when the threads happen to meet that way.
 *   step_race        two threads start a step at once, both having read the same word: each
 *                    must still get a step of its own.
 *   ring_payload     the same through the per-chunk ring (step tables and layer records).
 *   ring_lapped      a writer rewrites the slot while the reader copies its table (what a
 *                    second producer or a corrupting process does): the reader must refuse
 *                    the record, never deliver the torn table.
 *
 * The payload checks publish through the reader's handle: ThreadSanitizer follows release
 * and acquire per address, and the producer's mapping of the file is at another address than
 * the reader's (across processes the hardware sees one location; TSan sees two).
 *
 * Exit status 0 when the check holds; the reason on stderr otherwise. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LAYERS 2000
#define WORDS 64

static char path[256];
static pdhal_segment *producer, *reader;

static void die(const char *what, int rc)
{
    fprintf(stderr, "race_test: %s failed: %d (%s)\n", what, rc, pdhal_last_error());
    exit(2);
}

static void open_pair(uint32_t kind, uint32_t flags)
{
    snprintf(path, sizeof path, "/dev/shm/pdhal-race-%d-%u", (int)getpid(), kind);
    int rc = pdhal_segment_create(path, kind, 0, PDHAL_DEFAULT_RING_SLOTS, &producer);
    if (rc)
        die("pdhal_segment_create", rc);
    rc = pdhal_segment_open(path, kind, pdhal_now_ns() + 1000000000LL, flags, &reader);
    if (rc)
        die("pdhal_segment_open", rc);
}

static void close_pair(void)
{
    pdhal_segment_close(reader);
    pdhal_segment_close(producer);
}

/* ---- lost_wake ---- */

static _Atomic int reader_tid, writer_in_window, reader_waiting;

/* Is thread `tid` of this process asleep (state S), i.e. inside its futex wait? */
static int sleeping(int tid)
{
    char file[64], buf[256];
    snprintf(file, sizeof file, "/proc/self/task/%d/stat", tid);
    FILE *f = fopen(file, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *state = strrchr(buf, ')');
    return state && state[1] == ' ' && state[2] == 'S';
}

static void wait_until(_Atomic int *flag, int64_t limit_ns)
{
    int64_t end = pdhal_now_ns() + limit_ns;
    while (!atomic_load(flag) && pdhal_now_ns() < end)
        sched_yield();
}

/* Widen the window between the writer's two steps until the reader is asleep in the futex
 * (100 ms at most: with the correct order the reader never sleeps), and hold the reader
 * back from registering until the writer is inside that window. */
static void hook(enum pdhal_hook_point point)
{
    if (point == PDHAL_HOOK_WAIT_BEFORE_REGISTER && syscall(SYS_gettid) == reader_tid) {
        atomic_store(&reader_waiting, 1);
        wait_until(&writer_in_window, 1000000000LL);
    } else if (point == PDHAL_HOOK_WAKE_BETWEEN && atomic_load(&reader_waiting)) {
        atomic_store(&writer_in_window, 1);
        int64_t end = pdhal_now_ns() + 100000000LL;
        while (!sleeping(reader_tid) && pdhal_now_ns() < end)
            sched_yield();
    }
}

static void *lost_wake_reader(void *arg)
{
    (void)arg;
    reader_tid = (int)syscall(SYS_gettid);
    uint64_t now = 0;
    int64_t start = pdhal_now_ns();
    int rc;
    do
        rc = pdhal_progress_wait(reader, UINT64_C(1) << PDHAL_LAYER_BITS,
                                 pdhal_now_ns() + 2000000000LL, 0, &now);
    while (rc == -EINTR);
    if (rc)
        die("pdhal_progress_wait", rc);
    return (void *)(intptr_t)((pdhal_now_ns() - start) / 1000000);
}

static int lost_wake(void)
{
#ifdef PDHAL_TEST_HOOKS
    pdhal_test_hook = hook;
#else
    fprintf(stderr, "race_test: lost_wake needs a build with -DPDHAL_TEST_HOOKS\n");
    return 2;
#endif
    open_pair(PDHAL_KIND_QUERY, 0);
    uint64_t step;
    if (pdhal_progress_begin_step(producer, &step))
        die("pdhal_progress_begin_step", -1);
    pthread_t t;
    pthread_create(&t, NULL, lost_wake_reader, NULL);
    wait_until(&reader_waiting, 5000000000LL); /* it has read the word and found nothing */
    pdhal_progress_publish(producer, PDHAL_QUERY_SLOT, (step << PDHAL_LAYER_BITS) | 1);
    void *elapsed_ms;
    pthread_join(t, &elapsed_ms);
    close_pair();
    if ((intptr_t)elapsed_ms >= 150) {
        fprintf(stderr, "race_test: the reader saw the publish after %ld ms: its wake-up was "
                        "lost (it slept until its wait slice ended)\n", (long)(intptr_t)elapsed_ms);
        return 1;
    }
    return 0;
}

/* ---- query_payload ---- */

static uint64_t payload[LAYERS][WORDS]; /* plain memory: what a KV cache write is */

/* Relaxed on purpose: these flags must not order anything themselves, or they would hide
 * from ThreadSanitizer the very missing release/acquire they are there to expose. */
static _Atomic int forcing, writer_tid, first_published, first_read;

static void relaxed_wait_until(_Atomic int *flag, int64_t limit_ns)
{
    int64_t end = pdhal_now_ns() + limit_ns;
    while (!atomic_load_explicit(flag, memory_order_relaxed) && pdhal_now_ns() < end)
        sched_yield();
}

static void force_first_layer(enum pdhal_hook_point point)
{
    if (!atomic_load_explicit(&forcing, memory_order_relaxed))
        return;
    int tid = (int)syscall(SYS_gettid);
    if (point == PDHAL_HOOK_READ_SEQ && tid == atomic_load_explicit(&reader_tid, memory_order_relaxed)) {
        relaxed_wait_until(&first_published, 1000000000LL); /* seq read; progress after store */
    } else if (point == PDHAL_HOOK_PUBLISHED &&
               tid == atomic_load_explicit(&writer_tid, memory_order_relaxed)) {
        atomic_store_explicit(&first_published, 1, memory_order_relaxed);
        relaxed_wait_until(&first_read, 1000000000LL); /* the bump only after the read */
        atomic_store_explicit(&forcing, 0, memory_order_relaxed);
    }
}

static void *query_writer(void *arg)
{
    atomic_store_explicit(&writer_tid, (int)syscall(SYS_gettid), memory_order_relaxed);
    uint64_t step = *(uint64_t *)arg;
    for (int layer = 0; layer < LAYERS; layer++) {
        for (int i = 0; i < WORDS; i++)
            payload[layer][i] = (uint64_t)layer * WORDS + i;
        pdhal_progress_publish(reader, PDHAL_QUERY_SLOT,
                               (step << PDHAL_LAYER_BITS) | (uint64_t)(layer + 1));
    }
    return NULL;
}

static int query_payload(void)
{
#ifdef PDHAL_TEST_HOOKS
    pdhal_test_hook = force_first_layer;
    atomic_store_explicit(&forcing, 1, memory_order_relaxed);
#endif
    atomic_store_explicit(&reader_tid, (int)syscall(SYS_gettid), memory_order_relaxed);
    open_pair(PDHAL_KIND_QUERY, 0);
    uint64_t step;
    if (pdhal_progress_begin_step(producer, &step))
        die("pdhal_progress_begin_step", -1);
    pthread_t t;
    pthread_create(&t, NULL, query_writer, &step);
    uint64_t since = step << PDHAL_LAYER_BITS, now = 0;
    int bad = 0;
    while ((since & PDHAL_LAYER_MASK) < LAYERS) {
        int rc = pdhal_progress_wait(reader, since, pdhal_now_ns() + 10000000000LL, 0, &now);
        if (rc == -EINTR)
            continue;
        if (rc)
            die("pdhal_progress_wait", rc);
        for (uint64_t layer = since & PDHAL_LAYER_MASK; layer < (now & PDHAL_LAYER_MASK); layer++)
            for (int i = 0; i < WORDS; i++)
                bad += payload[layer][i] != layer * WORDS + i;
        atomic_store_explicit(&first_read, 1, memory_order_relaxed);
        since = now;
    }
    pthread_join(t, NULL);
    close_pair();
    if (bad)
        fprintf(stderr, "race_test: %d payload words read before they were written\n", bad);
    return bad != 0;
}

/* ---- ring_payload ---- */

#define STEPS 400
#define RING_LAYERS 4

static void *ring_writer(void *arg)
{
    (void)arg;
    for (int s = 1; s <= STEPS; s++) {
        int32_t table[3] = {s % 7, s, s + 1};
        uint64_t step;
        int rc;
        do
            rc = pdhal_ring_begin_step(producer, table, 1, RING_LAYERS,
                                       pdhal_now_ns() + 10000000000LL, &step);
        while (rc == -EINTR);
        if (rc)
            die("pdhal_ring_begin_step", rc);
        uint32_t slot = (uint32_t)(step % pdhal_segment_ring_slots(producer));
        for (int layer = 0; layer < RING_LAYERS; layer++) {
            for (int i = 0; i < WORDS; i++)
                payload[(s * RING_LAYERS + layer) % LAYERS][i] = (uint64_t)s * 1000 + layer + i;
            pdhal_progress_publish(reader, slot, (step << PDHAL_LAYER_BITS) | (layer + 1));
        }
    }
    return NULL;
}

static int ring_payload(void)
{
    open_pair(PDHAL_KIND_CHUNK, PDHAL_OPEN_EXCLUSIVE_READER);
    pthread_t t;
    pthread_create(&t, NULL, ring_writer, NULL);
    int32_t out[PDHAL_RECORD_WORDS];
    int bad = 0;
    for (int s = 1; s <= STEPS; s++) {
        for (int layer = 0; layer < RING_LAYERS; layer++) {
            uint64_t step;
            int rc;
            do
                rc = pdhal_ring_next(reader, out, PDHAL_RECORD_WORDS,
                                     pdhal_now_ns() + 10000000000LL, 0, &step);
            while (rc == -EINTR);
            if (rc != 1)
                die("pdhal_ring_next", rc);
            bad += step != (uint64_t)s || out[0] != 1 || out[1] != layer || out[2] != s % 7 ||
                   out[3] != s || out[4] != s + 1;
            /* the payload's slot may be rewritten by the time we look; the race detector
             * cares about the first read after the acquire, which is this one */
            volatile uint64_t first = payload[(s * RING_LAYERS + layer) % LAYERS][0];
            (void)first;
        }
    }
    pthread_join(t, NULL);
    close_pair();
    if (bad)
        fprintf(stderr, "race_test: %d records differ from what was published\n", bad);
    return bad != 0;
}

/* ---- ring_lapped ---- */

static void lap_the_slot(enum pdhal_hook_point point)
{
    if (point != PDHAL_HOOK_RING_COPIED)
        return;
    struct pdhal_ring_slot *slot = &reader->ring[1 % reader->ring_slots];
    atomic_store(&slot->progress, 0); /* as a writer starting to rewrite it does */
    atomic_store(&slot->table[0], 99);
}

static int ring_lapped(void)
{
#ifdef PDHAL_TEST_HOOKS
    pdhal_test_hook = lap_the_slot;
#else
    fprintf(stderr, "race_test: ring_lapped needs a build with -DPDHAL_TEST_HOOKS\n");
    return 2;
#endif
    open_pair(PDHAL_KIND_CHUNK, PDHAL_OPEN_EXCLUSIVE_READER);
    int32_t table[3] = {1, 2, 3}, out[PDHAL_RECORD_WORDS];
    uint64_t step;
    if (pdhal_ring_begin_step(producer, table, 1, 1, pdhal_now_ns() + 1000000000LL, &step))
        die("pdhal_ring_begin_step", -1);
    pdhal_progress_publish(producer, (uint32_t)(step % pdhal_segment_ring_slots(producer)),
                           (step << PDHAL_LAYER_BITS) | 1);
    int rc = pdhal_ring_next(reader, out, PDHAL_RECORD_WORDS, 0, 0, &step);
    close_pair();
    if (rc != -EPROTO) {
        fprintf(stderr, "race_test: a slot rewritten during the copy gave %d (record %d %d %d "
                        "%d %d), expected -EPROTO\n", rc, out[0], out[1], out[2], out[3], out[4]);
        return 1;
    }
    return 0;
}

/* ---- step_race ---- */

static _Atomic int arrivals;

/* The first two step starts meet here, each having read the word: both computed the same
 * next step, and only an atomic compare-and-swap keeps them apart. */
static void meet_after_reading(enum pdhal_hook_point point)
{
    if (point != PDHAL_HOOK_STEP_READ || atomic_fetch_add(&arrivals, 1) >= 2)
        return;
    int64_t end = pdhal_now_ns() + 1000000000LL;
    while (atomic_load(&arrivals) < 2 && pdhal_now_ns() < end)
        sched_yield();
}

static void *start_a_step(void *out)
{
    if (pdhal_progress_begin_step(producer, out))
        die("pdhal_progress_begin_step", -1);
    return NULL;
}

static int step_race(void)
{
#ifdef PDHAL_TEST_HOOKS
    pdhal_test_hook = meet_after_reading;
#else
    fprintf(stderr, "race_test: step_race needs a build with -DPDHAL_TEST_HOOKS\n");
    return 2;
#endif
    open_pair(PDHAL_KIND_QUERY, 0);
    uint64_t steps[2] = {0, 0};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, start_a_step, &steps[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    close_pair();
    if (steps[0] == steps[1]) {
        fprintf(stderr, "race_test: two threads starting a step at once both got step %llu\n",
                (unsigned long long)steps[0]);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: race_test lost_wake|query_payload|ring_payload|ring_lapped|step_race\n");
        return 2;
    }
    if (!strcmp(argv[1], "lost_wake"))
        return lost_wake();
    if (!strcmp(argv[1], "query_payload"))
        return query_payload();
    if (!strcmp(argv[1], "ring_payload"))
        return ring_payload();
    if (!strcmp(argv[1], "ring_lapped"))
        return ring_lapped();
    if (!strcmp(argv[1], "step_race"))
        return step_race();
    fprintf(stderr, "race_test: unknown check %s\n", argv[1]);
    return 2;
}
