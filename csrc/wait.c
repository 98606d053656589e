/* wait.c: futex waits on shared 32-bit words, with absolute CLOCK_MONOTONIC deadlines.
 *
 * Never FUTEX_PRIVATE_FLAG: waiter and waker live in different processes. */
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifdef PDHAL_TEST_HOOKS
void (*pdhal_test_hook)(enum pdhal_hook_point point);
#endif

int64_t pdhal_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t pdhal_wait_slice_ns(void)
{
    static _Atomic int64_t slice_ns; /* 0: not read yet (a race reads it twice, alike) */
    int64_t slice = atomic_load_explicit(&slice_ns, memory_order_relaxed);
    if (!slice) {
        const char *said = getenv("PDHAL_WAIT_SLICE_MS");
        char *end = NULL;
        long long ms = said && *said >= '0' && *said <= '9' ? strtoll(said, &end, 10) : 0;
        if (!end || *end || ms < 1 || ms > 3600 * 1000)
            ms = 200; /* digits only, as pdhal.check_environment, which names a bad value */
        slice = ms * 1000 * 1000;
        atomic_store_explicit(&slice_ns, slice, memory_order_relaxed);
    }
    return slice;
}

/* End of the next slice: liveness is probed between slices even when no wake comes. */
int64_t pdhal_deadline_slice(int64_t deadline_ns)
{
    int64_t now = pdhal_now_ns(), slice = pdhal_wait_slice_ns();
    if (deadline_ns - now > slice)
        return now + slice;
    return deadline_ns;
}

/* 0 when woken or the value differs (EAGAIN), -ETIMEDOUT, -EINTR. */
int pdhal_futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t deadline_ns)
{
    struct timespec abs = {.tv_sec = deadline_ns / 1000000000LL,
                           .tv_nsec = deadline_ns % 1000000000LL};
    long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_BITSET, expected, &abs, NULL,
                      FUTEX_BITSET_MATCH_ANY);
    if (rc == 0 || errno == EAGAIN)
        return 0;
    return -errno;
}

void pdhal_futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int pdhal_wait_change(_Atomic uint32_t *word, _Atomic uint32_t *waiters, uint32_t seen,
                      int64_t deadline_ns)
{
    if (pdhal_now_ns() >= deadline_ns)
        return -ETIMEDOUT;
    PDHAL_HOOK(PDHAL_HOOK_WAIT_BEFORE_REGISTER);
    /* seq_cst: pairs with the seq_cst bump + waiters load in pdhal_bump_and_wake, so either
     * the writer sees our registration or we see its new value (Dekker). */
    atomic_fetch_add(waiters, 1);
    int rc = 0;
    if (atomic_load(word) == seen) {
        rc = pdhal_futex_wait(word, seen, pdhal_deadline_slice(deadline_ns));
        /* A slice ended: hand control back (as -EINTR) so the caller's language runtime can
         * run signal handlers that were delivered to another thread; it calls again with the
         * same absolute deadline, and the liveness probe runs on entry. */
        if (rc == -ETIMEDOUT)
            rc = -EINTR;
    }
    atomic_fetch_sub(waiters, 1); /* seq_cst like the add; only a hint for writers */
    return rc;
}

int pdhal_wait_failed(int rc, const char *path)
{
    if (rc == -EINTR)
        return pdhal_fail(EINTR, "interrupted (a signal, or a wait slice ended)");
    return pdhal_fail(-rc, "futex wait on %s failed", path);
}

void pdhal_bump_and_wake(_Atomic uint32_t *word, _Atomic uint32_t *waiters)
{
    atomic_fetch_add(word, 1); /* seq_cst: pairs with pdhal_wait_change (bump, THEN look) */
    PDHAL_HOOK(PDHAL_HOOK_WAKE_BETWEEN);
    uint32_t sleeping = atomic_load(waiters);
    if (sleeping != 0)
        pdhal_futex_wake_all(word);
}
