/* A cache messager's loop in C, built the way an engine builds its extension: against the
 * installed header (pdhal.get_include()) and linked against pdhal.get_library(). The test
 * loads it into a Python process with ctypes. */
#include "pdhal.h"

#include <errno.h>

#define DEADLINE_NS 30000000000LL

/* Wait on the per-query channel at `path` from progress word `since` until `last`, and
 * record each word the waits return. Returns how many were recorded, or -errno. */
int messager_per_query(const char *path, uint64_t since, uint64_t last, uint64_t *seen, int cap)
{
    pdhal_segment *seg;
    int64_t deadline = pdhal_now_ns() + DEADLINE_NS;
    int rc;
    /* the core waits through its 200 ms slices for a producer that starts late */
    rc = pdhal_segment_open(path, PDHAL_KIND_QUERY, deadline, PDHAL_OPEN_UNINTERRUPTED, &seg);
    if (rc)
        return rc;
    uint64_t now = 0;
    int n = 0;
    while (since < last && n < cap) {
        do /* -EINTR: a wait slice ended, call again with the same deadline */
            rc = pdhal_progress_wait(seg, since, deadline, 0, &now);
        while (rc == -EINTR);
        if (rc)
            break;
        seen[n++] = since = now;
    }
    pdhal_segment_close(seg);
    return rc ? rc : n;
}

/* Read `count` per-chunk records from the channel at `path` into out (count rows of
 * PDHAL_RECORD_WORDS int32 words). Returns the records read, or -errno. */
int messager_per_chunk(const char *path, int count, int32_t *out)
{
    pdhal_segment *seg;
    int64_t deadline = pdhal_now_ns() + DEADLINE_NS;
    int rc;
    rc = pdhal_segment_open(path, PDHAL_KIND_CHUNK, deadline,
                            PDHAL_OPEN_EXCLUSIVE_READER | PDHAL_OPEN_UNINTERRUPTED, &seg);
    if (rc)
        return rc;
    int n = 0;
    while (n < count) {
        uint64_t step;
        rc = pdhal_ring_next(seg, out + (long)n * PDHAL_RECORD_WORDS, PDHAL_RECORD_WORDS,
                             deadline, 1000, &step);
        if (rc == -EINTR)
            continue;
        if (rc <= 0)
            break;
        n++;
    }
    pdhal_segment_close(seg);
    return rc < 0 ? rc : n;
}
