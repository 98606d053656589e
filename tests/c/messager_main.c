/* A cache messager as its own program, with no Python anywhere: messager.c's loops linked
 * against libpdhal.so (pdhal.get_library(standalone=True)).
 *
 *   messager_main per_query PATH SINCE LAST   prints each progress word the waits returned
 *   messager_main per_chunk PATH COUNT        prints step, layer and first triple per record
 */
#include "pdhal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int messager_per_query(const char *path, uint64_t since, uint64_t last, uint64_t *seen, int cap);
int messager_per_chunk(const char *path, int count, int32_t *out);

int main(int argc, char **argv)
{
    if (argc == 5 && !strcmp(argv[1], "per_query")) {
        uint64_t seen[4096];
        int n = messager_per_query(argv[2], strtoull(argv[3], NULL, 10),
                                   strtoull(argv[4], NULL, 10), seen, 4096);
        for (int i = 0; i < n; i++)
            printf("%" PRIu64 "\n", seen[i]);
        return n < 0 ? 1 : 0;
    }
    if (argc == 4 && !strcmp(argv[1], "per_chunk")) {
        int count = atoi(argv[3]);
        int32_t *out = calloc((size_t)count * PDHAL_RECORD_WORDS, sizeof *out);
        int n = messager_per_chunk(argv[2], count, out);
        for (int i = 0; i < n; i++) {
            int32_t *r = out + (size_t)i * PDHAL_RECORD_WORDS;
            printf("%d %d %d %d %d\n", r[0], r[1], r[2], r[3], r[4]);
        }
        free(out);
        return n < 0 ? 1 : 0;
    }
    fprintf(stderr, "usage: messager_main per_query PATH SINCE LAST | per_chunk PATH COUNT\n");
    return 2;
}
