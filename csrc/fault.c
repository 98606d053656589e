/* Copies into memory another process may take away, or from memory its caller may: a peer
 * that shrinks the file behind a shared mapping makes the next access to its lost pages
 * raise SIGBUS, and a source the caller unmapped (or protected) since it was checked raises
 * SIGSEGV; either would kill this process. pdhal_copy_guarded turns those faults, in the
 * copy and nowhere else, into -EFAULT: a thread-local jump buffer marks "inside a guarded
 * copy", and the handler of both signals (installed by the first guarded copy, and again by
 * any after a library replaced it; it chains to the one it replaced) jumps back only from
 * there. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

/* The signals a guarded copy turns into -EFAULT, and what each means there. */
static const struct {
    int sig;
    const char *means;
} guarded_signals[] = {
    {SIGBUS, "memory its owner took away (SIGBUS)"},
    {SIGSEGV, "unmapped or protected memory (SIGSEGV)"},
};
enum { GUARDED = sizeof guarded_signals / sizeof guarded_signals[0] };

/* Set only while this thread is inside a guarded copy. */
static _Thread_local sigjmp_buf *fault_jump;
/* The handler each guarded signal had before ours, by its place in guarded_signals. */
static struct sigaction previous[GUARDED];

static int place_of(int sig) {
    for (int i = 0; i < GUARDED; i++)
        if (guarded_signals[i].sig == sig)
            return i;
    return 0;
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *jump = fault_jump;
    if (jump != NULL) {
        fault_jump = NULL;
        siglongjmp(*jump, place_of(sig) + 1); /* SA_NODEFER: nothing blocked to restore */
    }
    /* Not a guarded copy's: whoever handled the signal before handles it; with no one, the
     * default comes back and the faulting instruction, run again, ends the process. */
    const struct sigaction *before = &previous[place_of(sig)];
    if ((before->sa_flags & SA_SIGINFO) && before->sa_sigaction != NULL) {
        before->sa_sigaction(sig, info, context);
    } else if (!(before->sa_flags & SA_SIGINFO) && before->sa_handler != SIG_DFL &&
               before->sa_handler != SIG_IGN) {
        before->sa_handler(sig);
    } else {
        signal(sig, SIG_DFL);
    }
}

static int is_ours(const struct sigaction *action) {
    return (action->sa_flags & SA_SIGINFO) && action->sa_sigaction == on_fault;
}

/* The handlers are ours: installed by the first call (chaining to the ones they replaced),
 * and again if a library installed its own since: paddle's import does (glog's failure
 * signal handler), and a guarded copy after it would otherwise end the process. One
 * sigaction query per signal when ours. */
int pdhal_guard_arm(void) {
    static pthread_mutex_t arming = PTHREAD_MUTEX_INITIALIZER;
    for (int i = 0; i < GUARDED; i++) {
        int sig = guarded_signals[i].sig;
        struct sigaction now;
        if (sigaction(sig, NULL, &now) != 0)
            return pdhal_fail(errno, "reading the handler of signal %d: %s", sig, strerror(errno));
        if (is_ours(&now))
            continue;
        pthread_mutex_lock(&arming);
        struct sigaction action, replaced;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        int rc = sigaction(sig, &action, &replaced) == 0 ? 0 : -errno;
        if (rc == 0 && !is_ours(&replaced))
            previous[i] = replaced; /* what a fault outside a guarded copy goes to now */
        pthread_mutex_unlock(&arming);
        if (rc)
            return pdhal_fail(-rc, "installing the handler of signal %d of guarded copies", sig);
    }
    return 0;
}

int pdhal_copy_guarded(void *dst, const void *src, uint64_t bytes) {
    int rc = pdhal_guard_arm();
    return rc ? rc : pdhal_copy_armed(dst, src, bytes);
}

int pdhal_copy_armed(void *dst, const void *src, uint64_t bytes) {
    struct pdhal_grid one = {.bytes = bytes, .count = 1, .rows = 1};
    return pdhal_copy_armed_grid(dst, src, &one);
}

/* One copy. Below a page it moves inline, 64 bytes at a time: a call per piece costs more
 * than the piece at a few hundred bytes, and glibc's copy of 2-KiB pieces (rep movsb, from
 * its threshold up) ran at half the speed of this loop on an AMD EPYC host (bench/
 * bench_block_sizes.py, decode blocks of 16 tokens of 128 bytes); a page and up go to memcpy. */
static inline void copy_piece(char *to, const char *from, uint64_t bytes) {
    if (bytes >= 4096) {
        memcpy(to, from, bytes);
        return;
    }
    uint64_t at = 0;
    for (; at + 64 <= bytes; at += 64)
        memcpy(to + at, from + at, 64);
    memcpy(to + at, from + at, bytes - at);
}

/* The copies themselves, in a frame of their own: nothing they change lives across the
 * guard's sigsetjmp. */
#define COPY_ROW(size)                                                                   \
    for (uint64_t j = 0; j < g->count; j++, to += g->dst_step, from += g->src_step)      \
        memcpy(to, from, size)

static __attribute__((noinline)) void copy_grid(char *dst, const char *src,
                                                const struct pdhal_grid *g) {
    for (uint64_t i = 0; i < g->rows; i++) {
        char *to = dst + i * g->dst_row;
        const char *from = src + i * g->src_row;
        /* a head's token is tens to hundreds of bytes: a size known here is moved inline,
         * without a call per piece */
        switch (g->bytes) {
        case 64: COPY_ROW(64); break;
        case 128: COPY_ROW(128); break;
        case 256: COPY_ROW(256); break;
        default:
            for (uint64_t j = 0; j < g->count; j++, to += g->dst_step, from += g->src_step)
                copy_piece(to, from, g->bytes);
            break;
        }
    }
}

static __attribute__((noinline)) void copy_columns(const struct pdhal_placed_grid *grids,
                                                   uint64_t n) {
    for (uint64_t j = 0; j < grids->grid.count; j++) {
        for (uint64_t i = 0; i < n; i++) {
            const struct pdhal_placed_grid *g = &grids[i];
            copy_piece(g->dst + j * g->grid.dst_step, g->src + j * g->grid.src_step, g->grid.bytes);
        }
    }
}

/* What a guarded copy runs: one grid, or `n` grids as columns. */
struct guarded_copy {
    const struct pdhal_placed_grid *grids;
    uint64_t n; /* 0: one grid, its rows in order */
};

/* `copy` under the guard: 0, or -EFAULT naming what the copy met. */
static int run_guarded(const struct guarded_copy *copy) {
    sigjmp_buf jump;
    int met = sigsetjmp(jump, 0);
    if (met != 0) {
        return pdhal_fail(EFAULT, "a copy of %llu bytes met %s",
                          (unsigned long long)copy->grids->grid.bytes,
                          guarded_signals[met - 1].means);
    }
    fault_jump = &jump;
    atomic_signal_fence(memory_order_seq_cst); /* pairs with the handler's read */
    if (copy->n)
        copy_columns(copy->grids, copy->n);
    else
        copy_grid(copy->grids->dst, copy->grids->src, &copy->grids->grid);
    atomic_signal_fence(memory_order_seq_cst);
    fault_jump = NULL;
    return 0;
}

int pdhal_copy_armed_columns(const struct pdhal_placed_grid *grids, uint64_t n) {
    struct guarded_copy copy = {.grids = grids, .n = n};
    return run_guarded(&copy);
}

int pdhal_copy_armed_grid(void *dst, const void *src, const struct pdhal_grid *grid) {
    struct pdhal_placed_grid one = {.dst = dst, .src = src, .grid = *grid};
    struct guarded_copy copy = {.grids = &one, .n = 0};
    return run_guarded(&copy);
}
