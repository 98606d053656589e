/* c_copy.c: pdhal_copy_blocks_layers against memmove, both called from C, as an engine's C++
 * op would call them (bench/bench_copy.py builds and loads this file).
 *
 * The memmove side is handed its runs of consecutive blocks, found before timing; pdhal
 * checks every id and finds the runs inside the timed call. The two are taken in turn,
 * one call of each (which goes first alternating), `reps` times, so that the machine's
 * drift weighs on both alike. */
#include <pdhal.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Seconds per call: out[0] pdhal_copy_blocks_layers, out[1] memmove of the same runs in
 * every layer. Returns pdhal's copies per call, or its negative errno. */
int bench_c_copy(void *const *dst, const void *const *src, uint64_t layers, uint64_t blocks,
                 uint64_t block_bytes, const int64_t *dst_ids, const int64_t *src_ids,
                 uint64_t count, int reps, double *out)
{
    uint64_t *runs = malloc(3 * (count + 1) * sizeof *runs); /* (dst, src, bytes) */
    if (!runs)
        return -12;
    uint64_t nruns = 0;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t to = (uint64_t)dst_ids[i] * block_bytes, from = (uint64_t)src_ids[i] * block_bytes;
        uint64_t *last = nruns ? runs + 3 * (nruns - 1) : NULL;
        if (last && last[0] + last[2] == to && last[1] + last[2] == from) {
            last[2] += block_bytes;
        } else {
            runs[3 * nruns] = to;
            runs[3 * nruns + 1] = from;
            runs[3 * nruns + 2] = block_bytes;
            nruns++;
        }
    }
    int copies = 0;
    double spent[2] = {0, 0};
    for (int rep = 0; rep < reps && copies >= 0; rep++) {
        for (int turn = 0; turn < 2; turn++) {
            int which = (turn + rep) % 2; /* which goes first alternates */
            double start = now();
            if (which == 0) {
                copies = pdhal_copy_blocks_layers(NULL, 0, NULL, dst, blocks, src, blocks,
                                                  layers, block_bytes, dst_ids, src_ids, count);
            } else {
                for (uint64_t layer = 0; layer < layers; layer++) {
                    for (uint64_t r = 0; r < nruns; r++)
                        memmove((char *)dst[layer] + runs[3 * r],
                                (const char *)src[layer] + runs[3 * r + 1], runs[3 * r + 2]);
                }
            }
            spent[which] += now() - start;
        }
    }
    free(runs);
    out[0] = spent[0] / reps;
    out[1] = spent[1] / reps;
    return copies;
}
