/*
 * fuzz_kernel.c: a libFuzzer target over what an engine's op hands pdhal's C core: kernel
 * words (a layer signal's or a sender's int64 words from a tensor) and block-copy ids.
 *
 *   make fuzz-ci    # 30 s of this target after fuzz_segment's modes
 *   make fuzz       # FUZZ_SECONDS
 *
 * Built from csrc/ with clang -fsanitize=fuzzer,address,undefined (see the Makefile). Each
 * input:
 *   byte 0 bit 0   0: words, 1: copies
 *   words          four int64 words (little-endian) are handed to pdhal_signal_store and
 *                  pdhal_kernel_sender; some inputs are first made "almost valid" (the tag
 *                  and the channel id of a real registered channel kept, the rest fuzzed),
 *                  so the lookups past the tag are reached. A store that comes back is run.
 *   copies         block size (1..64 bytes), block counts of both sides (0..32) and up to
 *                  64 id pairs, copied between two heap buffers with memmove. Beyond "no
 *                  crash": a copy that is accepted changes only the named destination
 *                  blocks, each to its source block; a refused one changes nothing.
 */
#define _GNU_SOURCE
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static pdhal_segment *g_query, *g_chunk;
static pdhal_sender *g_sender;
static int64_t g_query_id, g_chunk_id;
static char g_query_path[128], g_chunk_path[128];

static void cleanup(void)
{
    pdhal_sender_destroy(g_sender);
    pdhal_segment_close(g_query);
    pdhal_segment_close(g_chunk);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    snprintf(g_query_path, sizeof g_query_path, "/dev/shm/pdhal-fuzzk-%d-q", (int)getpid());
    snprintf(g_chunk_path, sizeof g_chunk_path, "/dev/shm/pdhal-fuzzk-%d-c", (int)getpid());
    if (pdhal_segment_create(g_query_path, PDHAL_KIND_QUERY, 0, 0, &g_query) ||
        pdhal_segment_create(g_chunk_path, PDHAL_KIND_CHUNK, 0, 4, &g_chunk) ||
        pdhal_sender_create(NULL, NULL, &g_sender)) {
        fprintf(stderr, "fuzz_kernel: set-up failed: %s\n", pdhal_last_error());
        abort();
    }
    g_query_id = pdhal_kernel_channel(g_query);
    g_chunk_id = pdhal_kernel_channel(g_chunk);
    atexit(cleanup);
    return 0;
}

static uint64_t take(const uint8_t **data, size_t *size, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n && *size; i++, (*data)++, (*size)--)
        v |= (uint64_t)**data << (8 * i);
    return v;
}

static void fuzz_words(uint8_t selector, const uint8_t *data, size_t size)
{
    int64_t words[PDHAL_KERNEL_WORDS];
    for (int i = 0; i < PDHAL_KERNEL_WORDS; i++)
        words[i] = (int64_t)take(&data, &size, 8);
    if (selector & 2) { /* almost valid: a real tag and channel, fuzzed slot and value */
        words[0] = selector & 4 ? PDHAL_KERNEL_NOOP : PDHAL_KERNEL_SIGNAL;
        words[1] = selector & 8 ? g_chunk_id : g_query_id;
        if (selector & 16)
            words[2] = PDHAL_QUERY_SLOT;
    }
    pdhal_store *store = pdhal_signal_store(words);
    if (store)
        pdhal_store_run(store); /* stores into our own channel: must stay inside it */
    if (selector & 32) {
        words[0] = PDHAL_KERNEL_SENDER;
        words[1] = selector & 64 ? pdhal_sender_kernel_id(g_sender) : words[1];
    }
    pdhal_sender *sender = pdhal_kernel_sender(words);
    if (sender && sender != g_sender)
        abort(); /* words may name our one sender, or nothing */
    if (sender)
        pdhal_sender_post(sender, NULL, pdhal_signal_store(words));
}

static void fuzz_copies(const uint8_t *data, size_t size)
{
    uint64_t block = 1 + take(&data, &size, 1) % 64;
    uint64_t dst_blocks = take(&data, &size, 1) % 33, src_blocks = take(&data, &size, 1) % 33;
    uint64_t count = take(&data, &size, 1) % 65;
    int64_t dst_ids[64], src_ids[64];
    for (uint64_t i = 0; i < count; i++) {
        /* mostly in range, sometimes anything: both paths matter */
        int64_t d = (int8_t)take(&data, &size, 1), s = (int8_t)take(&data, &size, 1);
        dst_ids[i] = d;
        src_ids[i] = s;
    }
    uint8_t *dst = malloc(dst_blocks * block + 1), *src = malloc(src_blocks * block + 1);
    uint8_t *before = malloc(dst_blocks * block + 1);
    for (uint64_t i = 0; i < src_blocks * block; i++)
        src[i] = (uint8_t)(i * 7 + 1);
    memset(dst, 0xEE, dst_blocks * block);
    memcpy(before, dst, dst_blocks * block);
    int rc = pdhal_copy_blocks(NULL, 0, NULL, dst, dst_blocks, src, src_blocks, block, dst_ids,
                               src_ids, count);
    if (rc < 0) {
        if (memcmp(dst, before, dst_blocks * block) != 0)
            abort(); /* refused, yet something was written */
    } else {
        /* Replay the copies on `before`, in order: the result must be identical. */
        for (uint64_t i = 0; i < count; i++)
            memmove(before + dst_ids[i] * block, src + src_ids[i] * block, block);
        if (memcmp(dst, before, dst_blocks * block) != 0)
            abort();
        if ((uint64_t)rc > count)
            abort();
    }
    free(dst);
    free(src);
    free(before);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    uint8_t selector = data[0];
    if (selector & 1)
        fuzz_copies(data + 1, size - 1);
    else
        fuzz_words(selector, data + 1, size - 1);
    return 0;
}
