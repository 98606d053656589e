/* What the size of a copy alone costs on this machine: `bytes` copied block by block (one
 * memcpy per block of `block` bytes, as caches alike are), against the very same bytes, the
 * same addresses in the same order, copied in the pieces a transfer between two block sizes
 * or two orders copies (a memcpy each, `pieces`' sizes over and over). Nothing is
 * scattered: the ratio is the floor such a transfer meets before any work of its own.
 * bench_block_sizes.py loads it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void copy_in(char *dst, const char *src, uint64_t bytes, const uint64_t *sizes,
                    uint64_t count)
{
    for (uint64_t at = 0, i = 0; at < bytes; at += sizes[i], i = (i + 1) % count)
        memcpy(dst + at, src + at, sizes[i]);
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median over `rounds` of each round's (time in blocks) / (time in pieces), the two
 * taken in turn; -1 when the memory cannot be had or the sizes do not divide (`pieces` must
 * add up to a whole number of blocks, and `bytes` be a whole number of such periods). */
double pieces_vs_blocks(uint64_t bytes, uint64_t block, const uint64_t *pieces, uint64_t count,
                        int rounds)
{
    uint64_t period = 0;
    for (uint64_t i = 0; i < count; i++)
        period += pieces[i] ? pieces[i] : bytes + 1; /* (a piece of 0 would never end) */
    if (!block || !period || period % block || bytes % period || rounds < 1 || rounds > 99)
        return -1;
    char *src = malloc(bytes), *dst = malloc(bytes);
    double ratios[99];
    if (!src || !dst) {
        free(src);
        free(dst);
        return -1;
    }
    memset(src, 1, bytes);
    memset(dst, 2, bytes);
    for (int r = 0; r < rounds; r++) {
        double t0 = now();
        copy_in(dst, src, bytes, &block, 1);
        double t1 = now();
        copy_in(dst, src, bytes, pieces, count);
        ratios[r] = (t1 - t0) / (now() - t1);
    }
    free(src);
    free(dst);
    qsort(ratios, (size_t)rounds, sizeof ratios[0], by_value);
    return ratios[rounds / 2];
}
