/* sender.c: the async KV signal sender, for devices with no host-function launch.
 *
 * One long-lived thread per sender sleeps on a condition variable; each posted entry is
 * (device event, pending store). The thread waits for the event through the backend's C
 * function pointer, runs the store, destroys the event, in posting order. No polling, no
 * Python and no GIL on that thread. Destroy drains the queue before joining. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct sender_entry {
    struct pdhal_work work; /* first: the worker's queue links it */
    void *event;
    pdhal_store *store;
};

struct pdhal_sender {
    pdhal_worker worker; /* its thread and queue of entries */
    /* release on the thread's decrement, acquire on reading it: a caller that sees pending
     * reach 0 also sees everything the thread did for those entries (stores, event frees) */
    _Atomic uint64_t pending;
    _Atomic uint64_t failures; /* a statistic: relaxed */
    pdhal_event_wait_fn wait;
    pdhal_event_destroy_fn destroy;
    _Atomic(pdhal_event_query_fn) query; /* polling (optional): set before the first post */
    _Atomic uint64_t poll_ns;
    int64_t kernel_id; /* kernel.c: this sender's id in kernel forms */
};

/* With a query function, poll the event while it is queued (work is in flight), yielding
 * between polls: a layer is seen within microseconds of its event instead of a blocking
 * wait's wake-up later. After poll_ns without the event, the blocking wait takes over (and
 * tells a failure from "not yet", which a query may not). An empty queue is never polled:
 * the thread sleeps on its condition variable. */
static int fired_while_polling(pdhal_sender *s, void *event)
{
    pdhal_event_query_fn query = atomic_load_explicit(&s->query, memory_order_acquire);
    if (!query)
        return 0;
    int64_t until = pdhal_now_ns() + (int64_t)atomic_load_explicit(&s->poll_ns,
                                                                  memory_order_relaxed);
    do {
        if (query(event) == 0)
            return 1;
        sched_yield();
    } while (pdhal_now_ns() < until);
    return 0;
}

static void *sender_main(void *arg)
{
    pdhal_sender *s = arg;
    for (;;) {
        struct sender_entry *e = (struct sender_entry *)pdhal_worker_take(&s->worker);
        if (!e)
            return NULL; /* stopping and drained */
        int rc = e->event && !fired_while_polling(s, e->event) && s->wait ? s->wait(e->event) : 0;
        if (rc == 0) {
            pdhal_store_run(e->store);
        } else {
            /* The device could not confirm the layer: publishing would claim data that may
             * not be there. Count it; destroy reports it. */
            atomic_fetch_add_explicit(&s->failures, 1, memory_order_relaxed);
            pdhal_store_free(e->store);
        }
        if (s->destroy && e->event)
            s->destroy(e->event);
        free(e);
        atomic_fetch_sub_explicit(&s->pending, 1, memory_order_release);
    }
}

int pdhal_sender_create(pdhal_event_wait_fn wait, pdhal_event_destroy_fn destroy,
                        pdhal_sender **out)
{
    *out = NULL;
    pdhal_sender *s = calloc(1, sizeof *s);
    if (!s)
        return pdhal_fail(ENOMEM, "out of memory");
    s->wait = wait;
    s->destroy = destroy;
    /* every signal blocked on the sender thread: Ctrl-C and friends go to Python's */
    int rc = pdhal_worker_start(&s->worker, sender_main, s);
    if (rc != 0) {
        free(s);
        return pdhal_fail(rc, "cannot start the sender thread: %s", strerror(rc));
    }
    pdhal_kernel_register_sender(s, &s->kernel_id);
    *out = s;
    return 0;
}

int64_t pdhal_sender_kernel_id(pdhal_sender *s) { return s->kernel_id; }

int pdhal_sender_set_polling(pdhal_sender *s, pdhal_event_query_fn query, uint64_t poll_ns)
{
    if (query && !s->wait)
        return pdhal_fail(EINVAL, "polling needs the blocking wait too (it takes over after "
                                  "poll_ns, and tells a failure apart)");
    atomic_store_explicit(&s->poll_ns, poll_ns, memory_order_relaxed);
    /* release: the thread that reads the query also sees poll_ns */
    atomic_store_explicit(&s->query, query, memory_order_release);
    return 0;
}

int pdhal_sender_post(pdhal_sender *s, void *event, pdhal_store *store)
{
    if (!s) { /* e.g. a kernel form that named no live sender: that call set the reason */
        pdhal_store_free(store);
        return -EBADF; /* not -EINVAL: the event is still the caller's to destroy */
    }
    if (!store || store == &pdhal_noop_store) { /* an error, or nothing to report */
        /* NULL comes from the lookup in the op's post line (pdhal_signal_store, ...): keep
         * its reason, which a caller of the one-line form can read only here. */
        char why[384];
        snprintf(why, sizeof why, "%s", pdhal_last_error());
        if (s->destroy && event)
            s->destroy(event);
        return store ? 0 : pdhal_fail(EINVAL, "no store to post (the signal could not be "
                                              "prepared: %s)", why);
    }
    struct sender_entry *e = malloc(sizeof *e);
    int rc = !e ? -ENOMEM : s->worker.pid != getpid() ? -ECHILD : 0;
    if (rc == 0) {
        e->event = event;
        e->store = store;
        atomic_fetch_add_explicit(&s->pending, 1, memory_order_relaxed);
        rc = pdhal_worker_put(&s->worker, &e->work);
        if (rc == 0)
            return 0;
        atomic_fetch_sub_explicit(&s->pending, 1, memory_order_relaxed);
    }
    free(e);
    pdhal_store_free(store);
    if (s->destroy && event)
        s->destroy(event);
    if (rc == -ECHILD)
        return pdhal_fail(ECHILD, "this sender belongs to pid %d; a forked child must create "
                                  "its own", (int)s->worker.pid);
    return rc == -EPIPE ? pdhal_fail(EPIPE, "the sender is being destroyed")
                        : pdhal_fail(ENOMEM, "out of memory");
}

int pdhal_sender_destroy(pdhal_sender *s)
{
    if (!s)
        return 0;
    if (s->worker.pid != getpid()) {
        /* Inherited across fork: the thread does not exist here. Free only what is ours. */
        for (struct pdhal_work *w = pdhal_worker_stop(&s->worker), *n; w; w = n) {
            n = w->next;
            pdhal_store_free(((struct sender_entry *)w)->store);
            free(w);
        }
        free(s);
        return 0;
    }
    pdhal_kernel_forget_sender(s, s->kernel_id); /* no new kernel-form posts find it */
    pdhal_worker_stop(&s->worker);
    int failures = (int)atomic_load_explicit(&s->failures, memory_order_relaxed); /* joined */
    free(s);
    return failures;
}

uint64_t pdhal_sender_pending(pdhal_sender *s)
{
    return atomic_load_explicit(&s->pending, memory_order_acquire);
}

uint64_t pdhal_sender_failures(pdhal_sender *s)
{
    return atomic_load_explicit(&s->failures, memory_order_relaxed);
}
