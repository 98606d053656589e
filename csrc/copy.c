/* copy.c: block copies between paged KV caches, the one loop every backend's copy op uses.
 *
 * A KV cache is an array of equal blocks; a transfer names blocks on both sides. The ids are
 * engine input: every one is checked against its side's extent before the first byte moves.
 * Runs of consecutive ids on both sides become one copy, issued through the runtime's own
 * asynchronous copy (cudaMemcpyAsync, xpu_memcpy_async) on the caller's stream, with no
 * Python between runs. */
#define _GNU_SOURCE
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <string.h>

/* -ERANGE naming the first id outside [0, blocks), or 0. */
static int check_ids(const int64_t *ids, uint64_t count, uint64_t blocks, const char *side)
{
    for (uint64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || (uint64_t)ids[i] >= blocks)
            return pdhal_fail(ERANGE, "%s block id %lld (entry %llu) is outside the cache's "
                                      "blocks 0..%lld",
                              side, (long long)ids[i], (unsigned long long)i,
                              (long long)blocks - 1);
    }
    return 0;
}

int pdhal_copy_blocks(pdhal_copy_fn copy, int kind, void *stream, void *dst, uint64_t dst_blocks,
                      const void *src, uint64_t src_blocks, uint64_t block_bytes,
                      const int64_t *dst_ids, const int64_t *src_ids, uint64_t count)
{
    return pdhal_copy_blocks_layers(copy, kind, stream, &dst, dst_blocks, &src, src_blocks, 1,
                                    block_bytes, dst_ids, src_ids, count);
}

int pdhal_copy_blocks_layers(pdhal_copy_fn copy, int kind, void *stream, void *const *dst,
                             uint64_t dst_blocks, const void *const *src, uint64_t src_blocks,
                             uint64_t layers, uint64_t block_bytes, const int64_t *dst_ids,
                             const int64_t *src_ids, uint64_t count)
{
    if (count == 0 || layers == 0)
        return 0;
    if (!dst || !src || !dst_ids || !src_ids || block_bytes == 0)
        return pdhal_fail(EINVAL, "a block copy needs both buffers, both id lists and a "
                                  "block size above 0");
    for (uint64_t layer = 0; layer < layers; layer++) {
        if (!dst[layer] || !src[layer])
            return pdhal_fail(EINVAL, "layer %llu of a block copy has no %s buffer",
                              (unsigned long long)layer, dst[layer] ? "source" : "destination");
    }
    if (count > INT_MAX / layers)
        return pdhal_fail(EINVAL, "%llu blocks in each of %llu layers in one copy, at most %d "
                                  "blocks in all",
                          (unsigned long long)count, (unsigned long long)layers, INT_MAX);
    /* The extents must be addressable: blocks * block_bytes may not wrap. */
    uint64_t most = dst_blocks > src_blocks ? dst_blocks : src_blocks;
    if (most > UINT64_MAX / block_bytes)
        return pdhal_fail(EINVAL, "%llu blocks of %llu bytes do not fit in an address space",
                          (unsigned long long)most, (unsigned long long)block_bytes);
    int rc = check_ids(dst_ids, count, dst_blocks, "destination");
    if (rc == 0)
        rc = check_ids(src_ids, count, src_blocks, "source");
    if (rc)
        return rc;
    int copies = 0;
    for (uint64_t layer = 0; layer < layers; layer++) {
        for (uint64_t i = 0; i < count;) {
            uint64_t run = 1;
            while (i + run < count && dst_ids[i + run] == dst_ids[i] + (int64_t)run &&
                   src_ids[i + run] == src_ids[i] + (int64_t)run)
                run++;
            char *to = (char *)dst[layer] + (uint64_t)dst_ids[i] * block_bytes;
            const char *from = (const char *)src[layer] + (uint64_t)src_ids[i] * block_bytes;
            if (copy) {
                int code = copy(to, from, run * block_bytes, kind, stream);
                if (code != 0)
                    return pdhal_fail(EIO, "the runtime's copy of %llu bytes (layer %llu, "
                                           "blocks %lld.. to %lld..) failed with code %d, "
                                           "after %d copies",
                                      (unsigned long long)(run * block_bytes),
                                      (unsigned long long)layer, (long long)src_ids[i],
                                      (long long)dst_ids[i], code, copies);
            } else {
                memmove(to, from, run * block_bytes);
            }
            copies++;
            i += run;
        }
    }
    return copies;
}
