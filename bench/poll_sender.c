/* poll_sender.c: the baseline for bench_sender.py, the design engines use on XPU today: a
 * helper thread that polls its queue every 1 us and waits for each event it finds. Written
 * in C, like the original, so the comparison is of designs, not languages. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

typedef int (*wait_fn)(void *);
typedef int (*destroy_fn)(void *);
typedef void (*store_fn)(void *);

struct entry { void *event, *store; struct entry *next; };
struct poll_sender {
    pthread_mutex_t lock;
    struct entry *head, *tail;
    int stop;
    wait_fn wait; destroy_fn destroy; store_fn store;
    pthread_t thread;
};

static void *run(void *arg)
{
    struct poll_sender *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->lock);
        struct entry *e = s->head;
        if (e) {
            s->head = e->next;
            if (!s->head) s->tail = NULL;
        }
        int stop = s->stop;
        pthread_mutex_unlock(&s->lock);
        if (!e) {
            if (stop) return NULL;
            struct timespec ts = {0, 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        s->wait(e->event);
        s->store(e->store);
        s->destroy(e->event);
        free(e);
    }
}

void *poll_sender_start(wait_fn w, destroy_fn d, store_fn st)
{
    struct poll_sender *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->lock, NULL);
    s->wait = w; s->destroy = d; s->store = st;
    pthread_create(&s->thread, NULL, run, s);
    return s;
}

void poll_sender_post(void *sender, void *event, void *store)
{
    struct poll_sender *s = sender;
    struct entry *e = calloc(1, sizeof *e);
    e->event = event; e->store = store;
    pthread_mutex_lock(&s->lock);
    if (s->tail) s->tail->next = e; else s->head = e;
    s->tail = e;
    pthread_mutex_unlock(&s->lock);
}

void poll_sender_stop(void *sender)
{
    struct poll_sender *s = sender;
    pthread_mutex_lock(&s->lock);
    s->stop = 1;
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    free(s);
}
