/* kernel.c: kernel forms, the way a device op (C/C++) names a layer signal or a sender.
 *
 * An op receives a few int64 words (a tensor argument), never a pointer: the words name a
 * producer channel or a sender registered in this process's tables, with a generation that
 * changes on every registration, so a stale, freed or garbage tensor is refused instead of
 * dereferenced. A lookup builds a pending store at once, while the words are alive; the
 * store owns what it writes, so the engine may drop the tensor right after the launch.
 *
 * The process's current per-chunk step (set at each step start) lets an op post "the next
 * layer" with no argument, as FastDeploy's ops do. One lock guards all of this state: it is
 * taken once per posted layer, never on the device or sender thread. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

#define TABLE_SLOTS 1024 /* live channels or senders of one process: far more than any use */
#define INDEX_BITS 16

struct entry {
    void *object; /* pdhal_segment * (holding a reference) or pdhal_sender * */
    uint64_t generation;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct entry channels[TABLE_SLOTS], senders[TABLE_SLOTS];
static uint64_t generations = 1; /* the next registration's generation, never reused */
static struct {
    pdhal_segment *seg; /* holding a reference; NULL when no step is current */
    uint64_t step;
    uint32_t num_layers, next_layer;
} current;

/* A forked child keeps none of its parent's registrations (the parent's handles and
 * threads are not its own); their references are the parent's to drop. */
static void forget_in_child(void)
{
    memset(channels, 0, sizeof channels);
    memset(senders, 0, sizeof senders);
    memset(&current, 0, sizeof current);
    pthread_mutex_init(&lock, NULL);
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) { pthread_atfork(NULL, NULL, forget_in_child); }

/* Register `object` in `table`: its id, or 0 when the table is full. Caller holds lock. */
static int64_t add(struct entry *table, void *object)
{
    for (uint32_t i = 0; i < TABLE_SLOTS; i++) {
        if (!table[i].object) {
            table[i].object = object;
            table[i].generation = generations++;
            return (int64_t)((table[i].generation << INDEX_BITS) | i);
        }
    }
    return 0;
}

/* The object `id` names in `table`, or NULL. Caller holds lock. */
static void *find(const struct entry *table, int64_t id)
{
    if (id <= 0)
        return NULL;
    uint64_t index = (uint64_t)id & ((1u << INDEX_BITS) - 1);
    if (index >= TABLE_SLOTS || table[index].generation != (uint64_t)id >> INDEX_BITS)
        return NULL;
    return table[index].object;
}

static void drop(struct entry *table, int64_t id, void *object)
{
    if (find(table, id) == object)
        table[(uint64_t)id & ((1u << INDEX_BITS) - 1)].object = NULL;
}

int64_t pdhal_kernel_channel(pdhal_segment *seg)
{
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&lock);
    if (!find(channels, seg->kernel_id)) {
        seg->kernel_id = add(channels, seg);
        if (seg->kernel_id)
            pdhal_segment_ref(seg);
    }
    int64_t id = seg->kernel_id;
    pthread_mutex_unlock(&lock);
    if (!id)
        pdhal_fail(ENFILE, "more than %d channels registered for kernel forms", TABLE_SLOTS);
    return id;
}

void pdhal_kernel_forget_channel(pdhal_segment *seg)
{
    pthread_mutex_lock(&lock);
    int registered = seg->kernel_id && find(channels, seg->kernel_id) == seg;
    drop(channels, seg->kernel_id, seg);
    seg->kernel_id = 0;
    /* A closed channel's step is over: its "next layer" would go to an unlinked file */
    int was_current = current.seg == seg;
    if (was_current)
        memset(&current, 0, sizeof current);
    pthread_mutex_unlock(&lock);
    if (registered)
        pdhal_segment_unref(seg);
    if (was_current)
        pdhal_segment_unref(seg);
}

pdhal_store *pdhal_signal_store(const int64_t *words)
{
    if (!words) {
        pdhal_fail(EINVAL, "no signal words (NULL)");
        return NULL;
    }
    if (words[0] == PDHAL_KERNEL_NOOP)
        return &pdhal_noop_store; /* a step with nothing to report */
    if (words[0] != PDHAL_KERNEL_SIGNAL) {
        pdhal_fail(EINVAL, "not a layer signal's kernel form (tag %#llx)",
                   (unsigned long long)words[0]);
        return NULL;
    }
    if (words[2] < 0 || words[2] > UINT32_MAX || words[3] <= 0) {
        pdhal_fail(EINVAL, "corrupt layer signal words (slot %lld, value %lld)",
                   (long long)words[2], (long long)words[3]);
        return NULL;
    }
    pthread_mutex_lock(&lock);
    pdhal_segment *seg = find(channels, words[1]);
    pdhal_store *store = seg ? pdhal_store_new(seg, (uint32_t)words[2], (uint64_t)words[3]) : NULL;
    pthread_mutex_unlock(&lock);
    if (!seg)
        pdhal_fail(ENOENT, "the layer signal names channel %lld, which this process does not "
                           "produce (closed, or words from another process)",
                   (long long)words[1]);
    return store;
}

int pdhal_chunk_set_current(pdhal_segment *seg, uint64_t step, uint32_t num_layers)
{
    if (seg && (!seg->ring || !seg->is_creator))
        return pdhal_fail(EINVAL, "the current per-chunk step needs a per-chunk channel this "
                                  "process produces");
    pthread_once(&atfork_once, install_atfork);
    if (seg && num_layers == 0) { /* clear, but only this channel's step */
        pthread_mutex_lock(&lock);
        pdhal_segment *old = current.seg == seg ? seg : NULL;
        if (old)
            memset(&current, 0, sizeof current);
        pthread_mutex_unlock(&lock);
        if (old)
            pdhal_segment_unref(old);
        return 0;
    }
    if (seg)
        pdhal_segment_ref(seg);
    pthread_mutex_lock(&lock);
    pdhal_segment *old = current.seg;
    current.seg = seg;
    current.step = step;
    current.num_layers = num_layers;
    current.next_layer = 0;
    pthread_mutex_unlock(&lock);
    if (old)
        pdhal_segment_unref(old);
    return 0;
}

pdhal_store *pdhal_next_chunk_layer_store(void)
{
    pthread_mutex_lock(&lock);
    pdhal_store *store = NULL;
    if (!current.seg) {
        pdhal_fail(ENOENT, "no per-chunk step is current in this process (none started, "
                           "the last one had no prefill request, or its channel was closed)");
    } else if (current.next_layer >= current.num_layers) {
        pdhal_fail(ERANGE, "step %llu has %u layers, and all were posted already",
                   (unsigned long long)current.step, current.num_layers);
    } else {
        uint32_t layer = current.next_layer++;
        store = pdhal_store_new(current.seg, (uint32_t)(current.step % current.seg->ring_slots),
                                (current.step << PDHAL_LAYER_BITS) | (layer + 1));
    }
    pthread_mutex_unlock(&lock);
    return store;
}

void pdhal_kernel_register_sender(pdhal_sender *sender, int64_t *id)
{
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&lock);
    *id = add(senders, sender);
    pthread_mutex_unlock(&lock);
}

void pdhal_kernel_forget_sender(pdhal_sender *sender, int64_t id)
{
    pthread_mutex_lock(&lock);
    drop(senders, id, sender);
    pthread_mutex_unlock(&lock);
}

pdhal_sender *pdhal_kernel_sender(const int64_t *words)
{
    if (!words || words[0] != PDHAL_KERNEL_SENDER) {
        pdhal_fail(EINVAL, "not a sender's kernel form");
        return NULL;
    }
    pthread_mutex_lock(&lock);
    pdhal_sender *sender = find(senders, words[1]);
    pthread_mutex_unlock(&lock);
    if (!sender)
        pdhal_fail(ENOENT, "the words name sender %lld, which is not alive in this process",
                   (long long)words[1]);
    return sender;
}
