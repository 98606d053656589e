/* ring.c: per-chunk progress, a ring of step slots each holding a request table.
 *
 * The producer publishes step s into slot s % ring_slots: seqlock-style, the slot's progress
 * word is zeroed, the table written, then progress = s << LAYER_BITS with release. Layer
 * signals then grow that word. The single reader walks (step, layer) in order and delivers
 * each exactly once; once a step's last layer was delivered and acknowledged (explicitly, or
 * by the reader asking for the next record) it advances `consumed`, which is what the
 * producer waits on (back-pressure) before reusing a slot, and only at step start, never
 * inside a device callback. A reader that dies between delivery and acknowledgement gets the
 * step again when it restarts.
 *
 * Everything read from the ring is input: the slot index comes from the handle's private
 * ring_slots, and a record count beyond PDHAL_MAX_REQUESTS is refused, never copied. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <time.h>

static uint64_t consumed(pdhal_segment *seg)
{
    /* acquire: pairs with the release store in advance_step */
    return atomic_load_explicit(&seg->hdr->consumed, memory_order_acquire);
}

/* Back-pressure: wait until the reader has finished step `need`, whose slot is reused next.
 * A reader that has not attached yet (or is restarting) is waited for the same way: the
 * producer never overwrites a step nobody has read. */
static int wait_for_reader(pdhal_segment *seg, uint64_t need, int64_t deadline_ns)
{
    struct pdhal_segment_header *h = seg->hdr;
    for (;;) {
        /* acquire: `consumed` read next is at least as new as this sequence value */
        uint32_t seen = atomic_load_explicit(&h->reader_seq, memory_order_acquire);
        if (consumed(seg) >= need)
            return 0;
        /* A reader that attached once and no longer holds its lock has died: say so now
         * rather than at the timeout. A restarted reader re-attaches and resumes. */
        int32_t reader = atomic_load_explicit(&h->reader_pid, memory_order_acquire);
        if (reader != 0) {
            int attached = pdhal_segment_reader_attached(seg);
            if (attached < 0)
                return attached;
            if (!attached)
                return pdhal_fail(EPIPE,
                                  "the reader of %s (pid %d) died with step %llu unread: restart "
                                  "the cache messager, it resumes there",
                                  seg->path, reader, (unsigned long long)(consumed(seg) + 1));
        }
        int rc = pdhal_wait_change(&h->reader_seq, &h->reader_waiters, seen, deadline_ns);
        if (rc == -ETIMEDOUT) {
            int attached = pdhal_segment_reader_attached(seg);
            return pdhal_fail(ETIMEDOUT,
                              "the reader of %s has not finished step %llu (consumed %llu): %s",
                              seg->path, (unsigned long long)need,
                              (unsigned long long)consumed(seg),
                              attached > 0 ? "the cache messager is stalled or too slow"
                                           : "no cache messager is attached");
        }
        if (rc < 0)
            return pdhal_wait_failed(rc, seg->path);
    }
}

/* Take the producer's publish lock by one wait slice before `deadline_ns`: 0, -ETIMEDOUT
 * once the deadline passed, -EINTR when only the slice ended (the caller calls again).
 * pthread_mutex_timedlock takes CLOCK_REALTIME: the slice (pdhal_wait_slice_ns) is converted at the
 * call, so a clock step can only lengthen or shorten one slice. */
static int lock_publish(pdhal_segment *seg, int64_t deadline_ns)
{
    int64_t until = pdhal_deadline_slice(deadline_ns);
    struct timespec abs;
    clock_gettime(CLOCK_REALTIME, &abs);
    int64_t wall = (int64_t)abs.tv_sec * 1000000000LL + abs.tv_nsec + (until - pdhal_now_ns());
    abs.tv_sec = wall / 1000000000LL;
    abs.tv_nsec = wall % 1000000000LL;
    int rc = pthread_mutex_timedlock(&seg->publish_lock, &abs);
    if (rc == 0)
        return 0;
    if (rc != ETIMEDOUT)
        return pdhal_fail(rc, "cannot lock %s for publishing", seg->path);
    if (until < deadline_ns)
        return pdhal_fail(EINTR, "interrupted (a wait slice ended)");
    return pdhal_fail(ETIMEDOUT, "another thread of this process kept %s busy publishing a "
                                 "step until the timeout", seg->path);
}

static int publish_step(pdhal_segment *seg, const int32_t *table, uint32_t count,
                        uint32_t num_layers, int64_t deadline_ns, uint64_t *step)
{
    struct pdhal_segment_header *h = seg->hdr;
    /* relaxed: only this process's producer writes latest_step, under publish_lock */
    uint64_t s = atomic_load_explicit(&h->latest_step, memory_order_relaxed) + 1;
    if (s > seg->ring_slots) {
        int rc = wait_for_reader(seg, s - seg->ring_slots, deadline_ns);
        if (rc)
            return rc;
    }
    struct pdhal_ring_slot *slot = &seg->ring[s % seg->ring_slots];
    /* Seqlock write: 0 marks the slot as being rewritten; the release fence orders that
     * before the table stores (pairs with the acquire fence in read_slot). */
    atomic_store_explicit(&slot->progress, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    for (uint32_t i = 0; i < 3 * count; i++)
        atomic_store_explicit(&slot->table[i], table[i], memory_order_relaxed);
    atomic_store_explicit(&slot->count, count, memory_order_relaxed); /* under the seqlock */
    atomic_store_explicit(&slot->num_layers, num_layers, memory_order_relaxed);
    /* release: the table is visible before the step is (pairs with acquire in read_slot) */
    atomic_store_explicit(&slot->progress, s << PDHAL_LAYER_BITS, memory_order_release);
    /* relaxed: latest_step is read only by this process's producer, under publish_lock */
    atomic_store_explicit(&h->latest_step, s, memory_order_relaxed);
    pdhal_bump_and_wake(&h->seq, &h->waiters);
    *step = s;
    return 0;
}

int pdhal_ring_begin_step(pdhal_segment *seg, const int32_t *table, uint32_t count,
                          uint32_t num_layers, int64_t deadline_ns, uint64_t *step)
{
    if (!seg->ring)
        return pdhal_fail(EPROTOTYPE, "%s is not a per-chunk channel", seg->path);
    if (!seg->is_creator)
        return pdhal_fail(EPERM, "%s was not created by this handle: only its producer "
                                 "publishes steps", seg->path);
    if (count > PDHAL_MAX_REQUESTS)
        return pdhal_fail(E2BIG, "%u requests in one step, at most %d fit", count,
                          PDHAL_MAX_REQUESTS);
    if (num_layers == 0 || num_layers > PDHAL_MAX_LAYER + 1)
        return pdhal_fail(EINVAL, "num_layers must be 1..%d, got %u", PDHAL_MAX_LAYER + 1,
                          num_layers);
    int rc = lock_publish(seg, deadline_ns);
    if (rc)
        return rc;
    rc = publish_step(seg, table, count, num_layers, deadline_ns, step);
    if (rc == 0) /* under the lock: steps of racing threads become current in step order */
        pdhal_chunk_set_current(seg, *step, num_layers);
    pthread_mutex_unlock(&seg->publish_lock);
    return rc;
}

/* The record at the cursor was the last of its step: move to the next step. The step is
 * not consumed yet; that waits for the acknowledgement (settle_ack). */
static void finish_step(pdhal_segment *seg)
{
    seg->unacked_step = seg->cursor_step;
    seg->cursor_step++;
    seg->cursor_layer = 0;
}

/* The reader acknowledged what it was given: a step delivered whole is consumed now. */
static void settle_ack(pdhal_segment *seg)
{
    if (!seg->unacked_step)
        return;
    struct pdhal_segment_header *h = seg->hdr;
    /* release: pairs with the acquire in consumed() on the producer side */
    atomic_store_explicit(&h->consumed, seg->unacked_step, memory_order_release);
    seg->unacked_step = 0;
    pdhal_bump_and_wake(&h->reader_seq, &h->reader_waiters);
}

enum slot_state { SLOT_NOT_YET, SLOT_READY, SLOT_LAPPED, SLOT_NO_ROOM };

/* Try to deliver the record at the cursor. */
static enum slot_state read_slot(pdhal_segment *seg, int32_t *out, uint32_t capacity)
{
    struct pdhal_ring_slot *slot = &seg->ring[seg->cursor_step % seg->ring_slots];
    uint64_t p = atomic_load_explicit(&slot->progress, memory_order_acquire);
    uint64_t pstep = p >> PDHAL_LAYER_BITS;
    if (pstep > seg->cursor_step)
        return SLOT_LAPPED;
    if (pstep < seg->cursor_step || (p & PDHAL_LAYER_MASK) <= seg->cursor_layer)
        return SLOT_NOT_YET;
    /* relaxed: read under the seqlock, validated by the re-check of progress below */
    uint32_t count = atomic_load_explicit(&slot->count, memory_order_relaxed);
    uint32_t num_layers = atomic_load_explicit(&slot->num_layers, memory_order_relaxed);
    if (count > PDHAL_MAX_REQUESTS)
        return SLOT_LAPPED;
    if (capacity < 2 + 3 * count)
        return SLOT_NO_ROOM;
    for (uint32_t i = 0; i < 3 * count; i++)
        out[2 + i] = atomic_load_explicit(&slot->table[i], memory_order_relaxed);
    PDHAL_HOOK(PDHAL_HOOK_RING_COPIED);
    /* acquire fence: pairs with the release fence of a writer that started rewriting the slot
     * while we copied; then the re-read of progress shows it. */
    atomic_thread_fence(memory_order_acquire);
    if ((atomic_load_explicit(&slot->progress, memory_order_relaxed) >> PDHAL_LAYER_BITS) !=
        seg->cursor_step)
        return SLOT_LAPPED;
    out[0] = (int32_t)count;
    out[1] = (int32_t)seg->cursor_layer;
    seg->cursor_layer++;
    if (seg->cursor_layer >= num_layers)
        finish_step(seg);
    return SLOT_READY;
}

/* Enter a reader call: this handle must be the channel's reader, used by one thread at a
 * time (two threads on one cursor would deliver a record twice). */
static int reader_enter(pdhal_segment *seg)
{
    if (!seg->ring)
        return pdhal_fail(EPROTOTYPE, "%s is not a per-chunk channel", seg->path);
    if (!seg->is_reader)
        return pdhal_fail(EPERM, "%s was not opened as its reader (PDHAL_OPEN_EXCLUSIVE_READER)",
                          seg->path);
    /* acquire/release: a thread entering after another left sees its cursor updates */
    if (atomic_exchange_explicit(&seg->reading, 1, memory_order_acquire))
        return pdhal_fail(EBUSY, "another thread is reading %s through this reader: one thread "
                                 "at a time reads a per-chunk channel", seg->path);
    return 0;
}

static int reader_leave(pdhal_segment *seg, int rc)
{
    atomic_store_explicit(&seg->reading, 0, memory_order_release);
    return rc;
}

int pdhal_ring_ack(pdhal_segment *seg)
{
    int rc = reader_enter(seg);
    if (rc)
        return rc;
    settle_ack(seg);
    return reader_leave(seg, 0);
}

static int next_record(pdhal_segment *seg, int32_t *out, uint32_t capacity, int64_t deadline_ns,
                       uint32_t spin_ns, uint64_t *step)
{
    struct pdhal_segment_header *h = seg->hdr;
    settle_ack(seg); /* asking for the next record acknowledges the last one */
    int64_t spin_end = deadline_ns > 0 && spin_ns ? pdhal_now_ns() + spin_ns : 0;
    if (spin_end > deadline_ns)
        spin_end = deadline_ns;
    for (;;) {
        /* acquire: the slot read next is at least as new as this sequence value */
        uint32_t seen = atomic_load_explicit(&h->seq, memory_order_acquire);
        *step = seg->cursor_step;
        switch (read_slot(seg, out, capacity)) {
        case SLOT_READY:
            return 1;
        case SLOT_NO_ROOM:
            return pdhal_fail(ENOBUFS, "output holds %u int32 words, the record needs more (up to %d)",
                              capacity, PDHAL_RECORD_WORDS);
        case SLOT_LAPPED:
            /* Back-pressure makes this impossible for a well-behaved producer. */
            return pdhal_fail(EPROTO, "step %llu of %s was overwritten before it was read: "
                                      "the channel is corrupt or has two producers",
                              (unsigned long long)seg->cursor_step, seg->path);
        case SLOT_NOT_YET:
            break;
        }
        if (spin_end && pdhal_now_ns() < spin_end)
            continue;
        int rc = pdhal_segment_require_producer(seg);
        if (rc)
            return rc;
        if (deadline_ns <= 0 || pdhal_now_ns() >= deadline_ns)
            return 0;
        rc = pdhal_wait_change(&h->seq, &h->waiters, seen, deadline_ns);
        if (rc < 0 && rc != -ETIMEDOUT) /* a timeout: loop, see nothing came, return 0 */
            return pdhal_wait_failed(rc, seg->path);
    }
}

int pdhal_ring_next(pdhal_segment *seg, int32_t *out, uint32_t capacity, int64_t deadline_ns,
                    uint32_t spin_ns, uint64_t *step)
{
    int rc = reader_enter(seg);
    if (rc)
        return rc;
    return reader_leave(seg, next_record(seg, out, capacity, deadline_ns, spin_ns, step));
}
