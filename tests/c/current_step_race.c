/* current_step_race.c: two threads of one producer start per-chunk steps at once; the step
 * that becomes the process's current one (whose layers a C op's "next layer" posts) must be
 * the later step, the one published last.
 *
 * Built from csrc/ by tests/protocol/test_current_step_race.py with -Wl,--wrap=pdhal_chunk_set_current:
 * ring.c's call to make its step current comes here first. Thread A publishes step 1 and,
 * on its way to making it current, is held until thread B has either published step 2 and
 * made it current (possible only if A no longer holds the publish lock: the bug) or is
 * asleep waiting for that lock (correct: A's step becomes current before B's can). Nothing
 * is left to timing: A waits for one of the two states, whichever comes.
 *
 * Exit status 0 when step 2 is current at the end; the reason on stderr otherwise. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

int __real_pdhal_chunk_set_current(pdhal_segment *seg, uint64_t step, uint32_t num_layers);

static pdhal_segment *producer;
static _Atomic int calls, a_holding, b_tid, b_done;
static uint64_t a_step, b_step;

static void die(const char *what, int rc)
{
    fprintf(stderr, "current_step_race: %s failed: %d (%s)\n", what, rc, pdhal_last_error());
    exit(2);
}

/* Is thread `tid` of this process asleep (state S): blocked on the publish lock? */
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

int __wrap_pdhal_chunk_set_current(pdhal_segment *seg, uint64_t step, uint32_t num_layers)
{
    if (num_layers && atomic_fetch_add(&calls, 1) == 0) { /* thread A, its step published */
        atomic_store(&a_holding, 1);
        while (!atomic_load(&b_done) && !(atomic_load(&b_tid) && sleeping(atomic_load(&b_tid))))
            sched_yield();
    }
    return __real_pdhal_chunk_set_current(seg, step, num_layers);
}

static void begin_step(uint64_t *step)
{
    const int32_t table[3] = {0, 0, 5};
    int rc;
    do /* -EINTR: a 200 ms wait slice for the lock ended; the caller calls again */
        rc = pdhal_ring_begin_step(producer, table, 1, 2, pdhal_now_ns() + 60000000000LL, step);
    while (rc == -EINTR);
    if (rc)
        die("pdhal_ring_begin_step", rc);
}

static void *thread_a(void *arg)
{
    (void)arg;
    begin_step(&a_step);
    return NULL;
}

static void *thread_b(void *arg)
{
    (void)arg;
    while (!atomic_load(&a_holding))
        sched_yield();
    atomic_store(&b_tid, (int)syscall(SYS_gettid));
    begin_step(&b_step);
    atomic_store(&b_done, 1);
    return NULL;
}

int main(void)
{
    char path[256];
    snprintf(path, sizeof path, "/dev/shm/pdhal-current-step-race-%d", (int)getpid());
    int rc = pdhal_segment_create(path, PDHAL_KIND_CHUNK, 0, PDHAL_DEFAULT_RING_SLOTS, &producer);
    if (rc)
        die("pdhal_segment_create", rc);
    pthread_t a, b;
    pthread_create(&b, NULL, thread_b, NULL);
    pthread_create(&a, NULL, thread_a, NULL);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    /* The op's next layer: it must belong to step 2, the step published last. */
    pdhal_store *store = pdhal_next_chunk_layer_store();
    if (!store)
        die("pdhal_next_chunk_layer_store", -1);
    pdhal_store_run(store);
    uint64_t got[2];
    for (int i = 0; i < 2; i++)
        got[i] = atomic_load(&producer->ring[1 + i].progress);
    pdhal_segment_close(producer);
    if (a_step != 1 || b_step != 2) {
        fprintf(stderr, "current_step_race: steps %llu and %llu, expected 1 and 2\n",
                (unsigned long long)a_step, (unsigned long long)b_step);
        return 2;
    }
    if (got[1] != ((2ULL << PDHAL_LAYER_BITS) | 1) || got[0] != 1ULL << PDHAL_LAYER_BITS) {
        fprintf(stderr, "current_step_race: the next layer went to the wrong step: slot 1 "
                        "holds %#llx, slot 2 %#llx (expected %#llx, %#llx)\n",
                (unsigned long long)got[0], (unsigned long long)got[1],
                1ULL << PDHAL_LAYER_BITS, (2ULL << PDHAL_LAYER_BITS) | 1);
        return 1;
    }
    return 0;
}
