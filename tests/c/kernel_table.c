/* kernel_table.c: fill the kernel-form channel table of one process (1024 channels) and
 * ask for one more: refused (0, ENFILE), and the table is never read or written past its
 * end. Built from csrc/ with AddressSanitizer by tests/protocol/test_kernel_forms.py, which sees an
 * access past the table even where the memory after it happens to look occupied.
 *
 * Usage: kernel_table FOLDER (the segments are made there and removed). Exit status 0 when
 * the table holds; the reason on stderr otherwise. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#define CHANNELS 1025

int main(int argc, char **argv)
{
    if (argc != 2)
        return 2;
    static pdhal_segment *segs[CHANNELS];
    int status = 0;
    for (int i = 0; i < CHANNELS && status == 0; i++) {
        char path[256];
        snprintf(path, sizeof path, "%s/channel-%d", argv[1], i);
        int rc = pdhal_segment_create(path, PDHAL_KIND_QUERY, 0, 0, &segs[i]);
        if (rc) {
            fprintf(stderr, "kernel_table: creating %s: %s\n", path, pdhal_last_error());
            return 2;
        }
        int64_t id = pdhal_kernel_channel(segs[i]);
        if (i < CHANNELS - 1 && id <= 0) {
            fprintf(stderr, "kernel_table: channel %d was refused: %s\n", i, pdhal_last_error());
            status = 1;
        } else if (i == CHANNELS - 1 && id != 0) {
            fprintf(stderr, "kernel_table: channel %d was registered (id %lld)\n", i,
                    (long long)id);
            status = 1;
        } else if (i == CHANNELS - 1 && !strstr(pdhal_last_error(), "more than 1024 channels")) {
            fprintf(stderr, "kernel_table: refused for another reason: %s\n", pdhal_last_error());
            status = 1;
        }
    }
    for (int i = 0; i < CHANNELS; i++)
        pdhal_segment_close(segs[i]);
    return status;
}
