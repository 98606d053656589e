/* progress.c: the per-query (step, layer) word, publishing from any thread, and waiting.
 *
 * Progress is state, not messages: one 64-bit word, (step << LAYER_BITS) | (layer + 1), that
 * only grows. Publishing is a lock-free "store if larger" followed by a sequence bump that
 * wakes futex waiters, so it is safe from a device host function or a sender thread. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <stdlib.h>

/* The progress word of `slot`, or NULL when the segment has no such slot. */
static _Atomic uint64_t *progress_word(pdhal_segment *seg, uint32_t slot)
{
    if (slot == PDHAL_QUERY_SLOT)
        return &seg->hdr->progress;
    if (seg->ring && slot < seg->ring_slots)
        return &seg->ring[slot].progress;
    return NULL;
}

uint64_t pdhal_progress_load(pdhal_segment *seg)
{
    /* acquire: pairs with the release CAS in pdhal_progress_publish */
    return atomic_load_explicit(&seg->hdr->progress, memory_order_acquire);
}

void pdhal_progress_publish(pdhal_segment *seg, uint32_t slot, uint64_t value)
{
    _Atomic uint64_t *word = progress_word(seg, slot);
    if (!word)
        return;
    /* relaxed: only a first guess for the compare-and-swap below, which re-reads it */
    uint64_t cur = atomic_load_explicit(word, memory_order_relaxed);
    /* release: pairs with the acquire loads of readers, so data written before the signal
     * (the layer's KV cache, the ring slot's table) is visible once the value is. A value
     * not larger than the current one is stale (a late signal of an older step): dropped. */
    while (cur < value && !atomic_compare_exchange_weak_explicit(
                              word, &cur, value, memory_order_release, memory_order_relaxed)) {
    }
    PDHAL_HOOK(PDHAL_HOOK_PUBLISHED);
    pdhal_bump_and_wake(&seg->hdr->seq, &seg->hdr->waiters);
}

int pdhal_progress_begin_step(pdhal_segment *seg, uint64_t *step)
{
    _Atomic uint64_t *word = &seg->hdr->progress;
    uint64_t cur = atomic_load_explicit(word, memory_order_relaxed); /* first guess, as above */
    uint64_t next;
    /* One compare-and-swap from the word we read: two threads starting steps at once (or a
     * layer landing meanwhile) make the loser retry, so every caller gets a step of its own.
     * release: pairs with the readers' acquire loads, as in pdhal_progress_publish. */
    do {
        next = (cur >> PDHAL_LAYER_BITS) + 1;
        if (next >> (64 - PDHAL_LAYER_BITS))
            return pdhal_fail(EOVERFLOW, "step counter of %s is exhausted", seg->path);
        PDHAL_HOOK(PDHAL_HOOK_STEP_READ);
    } while (!atomic_compare_exchange_weak_explicit(word, &cur, next << PDHAL_LAYER_BITS,
                                                    memory_order_release, memory_order_relaxed));
    pdhal_bump_and_wake(&seg->hdr->seq, &seg->hdr->waiters);
    *step = next;
    return 0;
}

int pdhal_progress_wait(pdhal_segment *seg, uint64_t since, int64_t deadline_ns, uint32_t spin_ns,
                        uint64_t *now)
{
    struct pdhal_segment_header *h = seg->hdr;
    if (spin_ns) {
        int64_t spin_end = pdhal_now_ns() + spin_ns;
        if (spin_end > deadline_ns)
            spin_end = deadline_ns;
        do {
            uint64_t v = pdhal_progress_load(seg);
            if (v > since) {
                *now = v;
                return 0;
            }
        } while (pdhal_now_ns() < spin_end);
    }
    for (;;) {
        /* acquire: the progress read next is at least as new as this sequence value */
        uint32_t seen = atomic_load_explicit(&h->seq, memory_order_acquire);
        PDHAL_HOOK(PDHAL_HOOK_READ_SEQ);
        uint64_t v = pdhal_progress_load(seg);
        if (v > since) {
            *now = v;
            return 0;
        }
        /* Checked after the progress, so the last layers a producer published before dying
         * are still delivered. */
        int rc = pdhal_segment_require_producer(seg);
        if (rc)
            return rc;
        rc = pdhal_wait_change(&h->seq, &h->waiters, seen, deadline_ns);
        if (rc == -ETIMEDOUT)
            return pdhal_fail(ETIMEDOUT, "no progress past step %llu layer %lld on %s",
                              (unsigned long long)(since >> PDHAL_LAYER_BITS),
                              (long long)(since & PDHAL_LAYER_MASK) - 1, seg->path);
        if (rc < 0)
            return pdhal_wait_failed(rc, seg->path);
    }
}

/* ---- pending stores ---- */

struct pdhal_store {
    pdhal_segment *seg; /* holds a reference: the mapping outlives a closed handle */
    uint32_t slot;
    uint64_t value;
};

/* What a kernel form of a step with nothing to report stands for: a store that stores
 * nothing and is never freed, so NULL always means an error. */
pdhal_store pdhal_noop_store;

pdhal_store *pdhal_store_new(pdhal_segment *seg, uint32_t slot, uint64_t value)
{
    if (!progress_word(seg, slot)) {
        pdhal_fail(EINVAL, "slot %u is not a progress slot of %s (it has %u ring slots)", slot,
                   seg->path, seg->ring_slots);
        return NULL;
    }
    pdhal_store *st = malloc(sizeof *st);
    if (!st) {
        pdhal_fail(ENOMEM, "out of memory");
        return NULL;
    }
    pdhal_segment_ref(seg);
    st->seg = seg;
    st->slot = slot;
    st->value = value;
    return st;
}

void pdhal_store_run(void *store)
{
    pdhal_store *st = store;
    if (!st || st == &pdhal_noop_store) /* NULL: an error the launch line did not check */
        return;
    pdhal_progress_publish(st->seg, st->slot, st->value);
    pdhal_store_free(st);
}

void pdhal_store_free(pdhal_store *store)
{
    if (!store || store == &pdhal_noop_store)
        return;
    pdhal_segment_unref(store->seg);
    free(store);
}
