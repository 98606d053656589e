"""Paged KV-cache blocks as pdhal.ops.copy_blocks names them, for code that builds on it
(an engine adapter such as pdhal.compat.fastdeploy, a transfer loop):

    from pdhal import blocks, ops
    ids = blocks.BlockIds(request_block_ids)          # converted once
    blocks.check_copy(dst_v, ids, src_v, ids, nbytes)  # everything checked, nothing copied
    ops.copy_blocks(dst_k, ids, src_k, ids, blocks.block_bytes_of(src_k))

memory_span names a range of memory pdhal handed out by its address (an int), bounded by
that memory, as copy_blocks takes it.
"""

from pdhal._memory.blocks import BlockIds, MemorySpan, block_bytes_of, check_copy, memory_span

__all__ = ["BlockIds", "MemorySpan", "block_bytes_of", "check_copy", "memory_span"]
