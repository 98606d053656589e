/* sim_device.c: streams as worker threads, events, shared-memory device memory, and
 * failure injection for the runtimes' entry points. */
#define _GNU_SOURCE
#include "sim_device.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static atomic_int live_events, live_streams, live_threads;

int sim_live_events(void) { return live_events; }
int sim_live_streams(void) { return live_streams; }
int sim_live_threads(void) { return live_threads; }

/* ---- failure injection: a small table of (function name, calls left to fail) ---- */

#define SIM_FAIL_NAMES 64

static struct failpoint {
    char name[64];
    int remaining; /* calls left to fail; -1: every call */
    int failed;    /* calls made to fail so far */
} failpoints[SIM_FAIL_NAMES];
static pthread_mutex_t fail_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int fail_armed; /* entries with remaining != 0: lets calls skip the lock */

/* The entry for `function`, made if `create`; NULL if absent (or no room). fail_lock held. */
static struct failpoint *failpoint(const char *function, int create)
{
    for (int i = 0; i < SIM_FAIL_NAMES && failpoints[i].name[0]; i++)
        if (strcmp(failpoints[i].name, function) == 0)
            return &failpoints[i];
    if (!create || strlen(function) >= sizeof failpoints[0].name)
        return NULL;
    for (int i = 0; i < SIM_FAIL_NAMES; i++)
        if (!failpoints[i].name[0]) {
            strcpy(failpoints[i].name, function);
            return &failpoints[i];
        }
    return NULL;
}

static void recount_armed(void)
{
    int armed = 0;
    for (int i = 0; i < SIM_FAIL_NAMES; i++)
        armed += failpoints[i].remaining != 0;
    atomic_store(&fail_armed, armed);
}

int sim_fail(const char *function, int count)
{
    pthread_mutex_lock(&fail_lock);
    struct failpoint *f = failpoint(function, 1);
    if (f)
        f->remaining = count < 0 ? -1 : count;
    recount_armed();
    pthread_mutex_unlock(&fail_lock);
    return f ? 0 : -1;
}

void sim_fail_clear(void)
{
    pthread_mutex_lock(&fail_lock);
    memset(failpoints, 0, sizeof failpoints);
    recount_armed();
    pthread_mutex_unlock(&fail_lock);
}

int sim_failed_calls(const char *function)
{
    pthread_mutex_lock(&fail_lock);
    struct failpoint *f = failpoint(function, 0);
    int failed = f ? f->failed : 0;
    pthread_mutex_unlock(&fail_lock);
    return failed;
}

int sim_should_fail(const char *function)
{
    if (!atomic_load(&fail_armed))
        return 0;
    pthread_mutex_lock(&fail_lock);
    struct failpoint *f = failpoint(function, 0);
    int fail = f && f->remaining != 0;
    if (fail) {
        f->failed++;
        if (f->remaining > 0 && --f->remaining == 0)
            recount_armed();
    }
    pthread_mutex_unlock(&fail_lock);
    return fail;
}

int sim_fail_armed(const char *function)
{
    if (!atomic_load(&fail_armed))
        return 0;
    pthread_mutex_lock(&fail_lock);
    struct failpoint *f = failpoint(function, 0);
    int armed = f && f->remaining != 0;
    pthread_mutex_unlock(&fail_lock);
    return armed;
}

/* SIM_FAIL="name[:count],...": failures armed before the first call (child processes). */
__attribute__((constructor)) static void fail_from_env(void)
{
    const char *env = getenv("SIM_FAIL");
    if (!env)
        return;
    char *copy = strdup(env), *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        int count = -1;
        if (colon) {
            *colon = '\0';
            count = atoi(colon + 1);
        }
        if (*item && sim_fail(item, count) != 0)
            fprintf(stderr, "sim: cannot inject failures into %s\n", item);
    }
    free(copy);
}

/* ---- events: a generation counter; record asks for the next generation ----
 * Like CUDA, an event may be destroyed while its record or a wait on it is still queued:
 * each queued task holds a reference, and the last one frees it. */

struct sim_event {
    atomic_int refs; /* the caller's, plus one per queued task naming it */
    pthread_mutex_t lock;
    pthread_cond_t fired;
    uint64_t recorded; /* generations recorded so far */
    uint64_t done;     /* generations whose record has run */
};

sim_event *sim_event_new(void)
{
    sim_event *e = calloc(1, sizeof *e);
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->fired, NULL);
    atomic_init(&e->refs, 1);
    atomic_fetch_add(&live_events, 1);
    return e;
}

static sim_event *event_ref(sim_event *e)
{
    atomic_fetch_add(&e->refs, 1);
    return e;
}

static void event_unref(sim_event *e)
{
    if (atomic_fetch_sub(&e->refs, 1) != 1)
        return;
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->fired);
    free(e);
}

void sim_event_free(sim_event *e)
{
    if (!e)
        return;
    atomic_fetch_sub(&live_events, 1); /* live to its owner until here */
    event_unref(e);
}

void sim_event_wait(sim_event *e)
{
    pthread_mutex_lock(&e->lock);
    while (e->done < e->recorded)
        pthread_cond_wait(&e->fired, &e->lock);
    pthread_mutex_unlock(&e->lock);
}

int sim_event_query(sim_event *e)
{
    pthread_mutex_lock(&e->lock);
    int done = e->done >= e->recorded;
    pthread_mutex_unlock(&e->lock);
    return done;
}

/* ---- streams ---- */

enum task_kind { TASK_FIRE, TASK_WAIT_EVENT, TASK_HOST_FN, TASK_WRITE, TASK_COPY, TASK_STOP };

struct task {
    enum task_kind kind;
    sim_event *event;
    uint64_t generation;
    void (*fn)(void *);
    void *arg;
    void *dst;
    void *src; /* owned copy for TASK_WRITE */
    uint64_t n;
    uint32_t delay_us;
    struct task *next;
};

struct sim_stream {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    struct task *head, *tail;
    uint64_t queued, finished;
    pthread_t thread;
};

static void run_task(struct task *t)
{
    switch (t->kind) {
    case TASK_FIRE:
        pthread_mutex_lock(&t->event->lock);
        if (t->event->done < t->generation)
            t->event->done = t->generation;
        pthread_cond_broadcast(&t->event->fired);
        pthread_mutex_unlock(&t->event->lock);
        event_unref(t->event);
        break;
    case TASK_WAIT_EVENT:
        pthread_mutex_lock(&t->event->lock);
        while (t->event->done < t->generation)
            pthread_cond_wait(&t->event->fired, &t->event->lock);
        pthread_mutex_unlock(&t->event->lock);
        event_unref(t->event);
        break;
    case TASK_HOST_FN:
        t->fn(t->arg);
        break;
    case TASK_WRITE: {
        struct timespec ts = {t->delay_us / 1000000, (long)(t->delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        memcpy(t->dst, t->src, t->n);
        free(t->src);
        break;
    }
    case TASK_COPY: /* reads its source when the stream reaches it, not at launch */
        memmove(t->dst, t->src, t->n);
        break;
    case TASK_STOP:
        break;
    }
}

static void *stream_main(void *arg)
{
    sim_stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        while (!s->head)
            pthread_cond_wait(&s->changed, &s->lock);
        struct task *t = s->head;
        s->head = t->next;
        if (!s->head)
            s->tail = NULL;
        pthread_mutex_unlock(&s->lock);
        int stop = t->kind == TASK_STOP;
        run_task(t);
        free(t);
        pthread_mutex_lock(&s->lock);
        s->finished++;
        pthread_cond_broadcast(&s->changed);
        pthread_mutex_unlock(&s->lock);
        if (stop)
            return NULL;
    }
}

static void enqueue(sim_stream *s, struct task *t)
{
    pthread_mutex_lock(&s->lock);
    t->next = NULL;
    if (s->tail)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    s->queued++;
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
}

sim_stream *sim_stream_new(void)
{
    sim_stream *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->changed, NULL);
    pthread_create(&s->thread, NULL, stream_main, s);
    atomic_fetch_add(&live_streams, 1);
    atomic_fetch_add(&live_threads, 1);
    return s;
}

void sim_stream_sync(sim_stream *s)
{
    pthread_mutex_lock(&s->lock);
    uint64_t target = s->queued;
    while (s->finished < target)
        pthread_cond_wait(&s->changed, &s->lock);
    pthread_mutex_unlock(&s->lock);
}

void sim_stream_free(sim_stream *s)
{
    if (!s)
        return;
    struct task *t = calloc(1, sizeof *t);
    t->kind = TASK_STOP;
    enqueue(s, t);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->changed);
    free(s);
    atomic_fetch_sub(&live_streams, 1);
    atomic_fetch_sub(&live_threads, 1);
}

static sim_stream *default_stream;
static pthread_once_t default_once = PTHREAD_ONCE_INIT;
static void make_default(void) { default_stream = sim_stream_new(); }

sim_stream *sim_default_stream(void)
{
    pthread_once(&default_once, make_default);
    return default_stream;
}

void sim_stream_host_fn(sim_stream *s, void (*fn)(void *), void *arg)
{
    struct task *t = calloc(1, sizeof *t);
    t->kind = TASK_HOST_FN;
    t->fn = fn;
    t->arg = arg;
    enqueue(s, t);
}

void sim_stream_write(sim_stream *s, void *dst, const void *src, uint64_t n, uint32_t delay_us)
{
    struct task *t = calloc(1, sizeof *t);
    t->kind = TASK_WRITE;
    t->dst = dst;
    t->src = malloc(n ? n : 1);
    memcpy(t->src, src, n); /* like a kernel argument: captured at launch */
    t->n = n;
    t->delay_us = delay_us;
    enqueue(s, t);
}

void sim_stream_copy(sim_stream *s, void *dst, const void *src, uint64_t n)
{
    struct task *t = calloc(1, sizeof *t);
    t->kind = TASK_COPY;
    t->dst = dst;
    t->src = (void *)src;
    t->n = n;
    enqueue(s, t);
}

void sim_event_record(sim_event *e, sim_stream *s)
{
    struct task *t = calloc(1, sizeof *t);
    t->kind = TASK_FIRE;
    t->event = event_ref(e);
    pthread_mutex_lock(&e->lock);
    t->generation = ++e->recorded;
    pthread_mutex_unlock(&e->lock);
    enqueue(s, t);
}

void sim_stream_wait_event(sim_stream *s, sim_event *e)
{
    struct task *t = calloc(1, sizeof *t);
    t->kind = TASK_WAIT_EVENT;
    t->event = event_ref(e);
    pthread_mutex_lock(&e->lock);
    t->generation = e->recorded;
    pthread_mutex_unlock(&e->lock);
    enqueue(s, t);
}

/* ---- device memory ---- */

struct allocation {
    char *base;
    uint64_t size;
    char name[48];
    char *peer; /* second mapping, made on first request */
    struct allocation *next;
};

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct allocation *allocations;
static atomic_int alloc_counter;

static struct allocation *find(const void *ptr)
{
    for (struct allocation *a = allocations; a; a = a->next)
        if ((const char *)ptr >= a->base && (const char *)ptr < a->base + a->size)
            return a;
    return NULL;
}

void *sim_malloc(uint64_t size)
{
    struct allocation *a = calloc(1, sizeof *a);
    /* The counter's address tells apart two simulated runtimes loaded in one process. */
    snprintf(a->name, sizeof a->name, "/pdhalsim.%d.%lx.%d", (int)getpid(),
             (unsigned long)(uintptr_t)&alloc_counter, atomic_fetch_add(&alloc_counter, 1));
    int fd = shm_open(a->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        free(a);
        return NULL;
    }
    a->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    a->size = size;
    pthread_mutex_lock(&mem_lock);
    a->next = allocations;
    allocations = a;
    pthread_mutex_unlock(&mem_lock);
    return a->base;
}

int sim_free(void *ptr)
{
    pthread_mutex_lock(&mem_lock);
    for (struct allocation **p = &allocations; *p; p = &(*p)->next) {
        struct allocation *a = *p;
        if (a->base == ptr) {
            *p = a->next;
            pthread_mutex_unlock(&mem_lock);
            munmap(a->base, a->size);
            if (a->peer)
                munmap(a->peer, a->size);
            shm_unlink(a->name);
            free(a);
            return 0;
        }
    }
    pthread_mutex_unlock(&mem_lock);
    return -1;
}

/* Another process's allocations mapped here by sim_ipc_open: their range is known, as a real
 * runtime knows an IPC mapping's (never freed: a real close keeps nothing to check). */
static struct allocation *imports;

int sim_alloc_range(const void *ptr, void **base, uint64_t *size)
{
    pthread_mutex_lock(&mem_lock);
    struct allocation *a = find(ptr);
    for (struct allocation *i = imports; !a && i; i = i->next)
        if ((const char *)ptr >= i->base && (const char *)ptr < i->base + i->size)
            a = i;
    if (a) {
        *base = a->base;
        *size = a->size;
    }
    pthread_mutex_unlock(&mem_lock);
    return a ? 0 : -1;
}

/* Handle layout: name (48 bytes) | offset (8) | size of the mapping needed (8). */
int sim_ipc_handle(void *ptr, char handle[64])
{
    pthread_mutex_lock(&mem_lock);
    struct allocation *a = find(ptr);
    if (a) {
        uint64_t offset = (uint64_t)((char *)ptr - a->base);
        memset(handle, 0, 64);
        memcpy(handle, a->name, sizeof a->name);
        memcpy(handle + 48, &offset, 8);
        memcpy(handle + 56, &a->size, 8);
    }
    pthread_mutex_unlock(&mem_lock);
    return a ? 0 : -1;
}

void *sim_ipc_open(const char handle[64])
{
    char name[49] = {0};
    uint64_t offset, size;
    memcpy(name, handle, 48);
    memcpy(&offset, handle + 48, 8);
    memcpy(&size, handle + 56, 8);
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0)
        return NULL;
    char *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return NULL;
    struct allocation *i = calloc(1, sizeof *i);
    if (i) {
        i->base = base;
        i->size = size;
        pthread_mutex_lock(&mem_lock);
        i->next = imports;
        imports = i;
        pthread_mutex_unlock(&mem_lock);
    }
    return base + offset;
}

void *sim_peer_alias(const void *ptr)
{
    void *alias = NULL;
    pthread_mutex_lock(&mem_lock);
    struct allocation *a = find(ptr);
    if (a) {
        if (!a->peer) {
            int fd = shm_open(a->name, O_RDWR, 0);
            if (fd >= 0) {
                a->peer = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                close(fd);
            }
        }
        if (a->peer && a->peer != MAP_FAILED)
            alias = a->peer + ((const char *)ptr - a->base);
    }
    pthread_mutex_unlock(&mem_lock);
    return alias;
}

/* Device memory of a process that exits is gone: remove its backing files. */
__attribute__((destructor)) static void release_all(void)
{
    pthread_mutex_lock(&mem_lock);
    for (struct allocation *a = allocations; a; a = a->next)
        shm_unlink(a->name);
    pthread_mutex_unlock(&mem_lock);
}
