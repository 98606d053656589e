/* One-way signal latency between two processes with C on both ends, through pdhal's public
 * header: the path an engine's C++ cache messager (or a CUDA host function feeding a C
 * reader) takes, without a Python interpreter waking up on either side.
 *
 *   c_wake futex|poll|pipe SIGNALS GAP_US   prints each signal's latency in microseconds
 *
 * The producer (parent) publishes layer i of step 1 every GAP_US..~2*GAP_US microseconds;
 * the reader (child) waits in pdhal_progress_wait (futex) or polls pdhal_progress_load with
 * a 1 ms sleep, and stamps when it sees each layer. "pipe" is the floor: the producer writes
 * a byte to a pipe after publishing and the reader blocks in read(), the plainest wake-up a
 * process has. Built and run by bench_signals.py. */
#define _GNU_SOURCE
#include "pdhal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

enum style { FUTEX, POLL, PIPE };

static int read_all(const char *path, enum style style, int pipe_fd, int n, int64_t *seen)
{
    pdhal_segment *seg;
    if (pdhal_segment_open(path, PDHAL_KIND_QUERY, pdhal_now_ns() + 10000000000LL, 0, &seg))
        return fprintf(stderr, "open: %s\n", pdhal_last_error()), 1;
    uint64_t since = pdhal_progress_load(seg), now;
    uint64_t last = (1ULL << PDHAL_LAYER_BITS) | (uint64_t)n; /* step 1, layer n - 1 */
    while (since < last) {
        if (style == PIPE) {
            char byte;
            if (read(pipe_fd, &byte, 1) != 1)
                return perror("read"), 1;
            now = since + 1;
        } else if (style == FUTEX) {
            int rc;
            do /* a wait returns -EINTR at each slice end, for callers that check signals */
                rc = pdhal_progress_wait(seg, since, pdhal_now_ns() + 10000000000LL, 0, &now);
            while (rc == -EINTR);
            if (rc)
                return fprintf(stderr, "wait: %s\n", pdhal_last_error()), 1;
        } else if ((now = pdhal_progress_load(seg)) <= since) {
            sleep_us(1000);
            continue;
        }
        seen[(now & ((1ULL << PDHAL_LAYER_BITS) - 1)) - 1] = pdhal_now_ns();
        since = now;
    }
    pdhal_segment_close(seg);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4)
        return fprintf(stderr, "usage: c_wake futex|poll|pipe SIGNALS GAP_US\n"), 2;
    enum style style = strcmp(argv[1], "futex") == 0 ? FUTEX
                       : strcmp(argv[1], "pipe") == 0 ? PIPE : POLL;
    int n = atoi(argv[2]), fds[2];
    if (pipe(fds))
        return perror("pipe"), 1;
    long gap = atol(argv[3]);
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/pdhal.%d.cwake%d.query.r0.d0", (int)geteuid(),
             (int)getpid());
    pdhal_segment *seg;
    uint64_t step;
    if (pdhal_segment_create(path, PDHAL_KIND_QUERY, 0, 0, &seg) ||
        pdhal_progress_begin_step(seg, &step))
        return fprintf(stderr, "create: %s\n", pdhal_last_error()), 1;
    /* seen[] is shared with the reader; 0 = the poller never saw that layer */
    int64_t *seen = mmap(NULL, n * sizeof *seen, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int64_t *sent = calloc(n, sizeof *sent), *lat = calloc(n, sizeof *lat);
    pid_t child = fork();
    if (child == 0)
        _exit(read_all(path, style, fds[0], n, seen));
    sleep_us(200000); /* the reader is attached and asleep */
    for (int i = 0; i < n; i++) {
        sleep_us(gap + (i % 7) * gap / 7);
        sent[i] = pdhal_now_ns();
        if (style == PIPE) {
            if (write(fds[1], "x", 1) != 1)
                return perror("write"), 1;
        } else {
            pdhal_progress_publish(seg, PDHAL_QUERY_SLOT,
                                   (step << PDHAL_LAYER_BITS) | (uint64_t)(i + 1));
        }
    }
    int status;
    waitpid(child, &status, 0);
    pdhal_segment_close(seg);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (seen[i])
            lat[m++] = seen[i] - sent[i];
    if (!WIFEXITED(status) || WEXITSTATUS(status) || m == 0)
        return fprintf(stderr, "reader failed\n"), 1;
    for (int i = 0; i < m; i++)
        printf("%.3f\n", lat[i] / 1e3);
    return 0;
}
