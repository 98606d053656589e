/* worker.c: one thread taking queued items in posting order, with no Python and no GIL:
 * the signal sender's (sender.c) and the shm link's copier (copier.c). An item is a struct
 * whose first member is a pdhal_work; the thread blocks on a condition variable while the
 * queue is empty, and stopping lets it take what was queued before it ends. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <signal.h>
#include <unistd.h>

int pdhal_worker_start(pdhal_worker *w, void *(*main)(void *), void *arg)
{
    w->head = w->tail = NULL;
    w->stopping = 0;
    w->pid = getpid();
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    /* Signals go to threads that run Python's handlers, but for those a thread raises itself
     * (a fault: the copier's guarded copies catch SIGBUS and SIGSEGV), which must come to
     * it: the kernel ends a process whose thread faults with the signal blocked. */
    static const int faults[] = {SIGBUS, SIGSEGV, SIGFPE, SIGILL};
    sigset_t blocked, old;
    sigfillset(&blocked);
    for (unsigned i = 0; i < sizeof faults / sizeof faults[0]; i++)
        sigdelset(&blocked, faults[i]);
    pthread_sigmask(SIG_SETMASK, &blocked, &old);
    int rc = pthread_create(&w->thread, NULL, main, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        pthread_mutex_destroy(&w->lock);
        pthread_cond_destroy(&w->wake);
    }
    return rc;
}

struct pdhal_work *pdhal_worker_take(pdhal_worker *w)
{
    pthread_mutex_lock(&w->lock);
    while (!w->head && !w->stopping)
        pthread_cond_wait(&w->wake, &w->lock);
    struct pdhal_work *item = w->head;
    if (item) {
        w->head = item->next;
        if (!w->head)
            w->tail = NULL;
    }
    pthread_mutex_unlock(&w->lock);
    return item;
}

int pdhal_worker_put(pdhal_worker *w, struct pdhal_work *item)
{
    item->next = NULL;
    pthread_mutex_lock(&w->lock);
    if (w->stopping) {
        pthread_mutex_unlock(&w->lock);
        return -EPIPE;
    }
    if (w->tail)
        w->tail->next = item;
    else
        w->head = item;
    w->tail = item;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    return 0;
}

struct pdhal_work *pdhal_worker_stop(pdhal_worker *w)
{
    if (w->pid != getpid())
        return w->head; /* inherited across fork: no thread here, and its lock may be held */
    pthread_mutex_lock(&w->lock);
    w->stopping = 1;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL); /* after it took every item queued */
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->wake);
    return NULL;
}
