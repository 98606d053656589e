"""pdhal.blocks, the public names for blocks and pdhal memory that an adapter or a transfer
loop builds on: ids converted once (and sliced), a copy checked without copying, a cache's
block size, and a span of pdhal memory named by its address, bounded by that memory."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import pdhal
from pdhal import blocks, ops

BLOCK = 16


def test_block_ids_convert_once_and_slice_into_ids_of_their_own():
    ids = blocks.BlockIds(np.array([7, 3, 4, 9], dtype=np.int64))
    assert len(ids) == 4 and ids.tolist() == [7, 3, 4, 9] and list(ids) == [7, 3, 4, 9]
    first = ids[:2]
    del ids  # the slice owns its memory: no view into the freed conversion
    assert isinstance(first, blocks.BlockIds) and first.tolist() == [7, 3]
    assert first[1] == 3 and first[-1] == 3
    assert blocks.BlockIds([1, 2, 3])[::2] == blocks.BlockIds([1, 3])
    assert blocks.BlockIds([5])[3:].tolist() == []
    with pytest.raises(pdhal.InvalidArgumentError, match="block_ids must hold integer"):
        blocks.BlockIds([1.5])


def test_ids_converted_once_copy_like_the_ids_they_came_from():
    src = np.arange(6 * BLOCK, dtype=np.uint8).reshape(6, BLOCK)
    dst = np.zeros_like(src)
    ids = blocks.BlockIds([4, 5, 0])
    assert ops.copy_blocks(dst, ids, src, [0, 1, 2], BLOCK) == 2  # [4, 5] <- [0, 1], [0] <- [2]
    assert (dst[[4, 5, 0]] == src[[0, 1, 2]]).all()


def test_check_copy_refuses_what_copy_blocks_would_and_copies_nothing():
    src = np.arange(4 * BLOCK, dtype=np.uint8).reshape(4, BLOCK)
    dst = np.zeros_like(src)
    blocks.check_copy(dst, [0, 3], src, [1, 2], BLOCK)
    assert not dst.any(), "a check copied"
    with pytest.raises(pdhal.InvalidArgumentError, match="source block id 4 \\(entry 1\\)"):
        blocks.check_copy(dst, [0, 1], src, [0, 4], BLOCK)
    with pytest.raises(pdhal.InvalidArgumentError, match="must pair up, got 1 and 2"):
        blocks.check_copy(dst, [0], src, [0, 1], BLOCK)


def test_check_copy_refuses_freed_memory_as_copy_blocks_does():
    """A span named while its buffer lived, checked after the free: refused by the check as
    by the copy (a check that passed would let an op's first copies go before the freed
    one failed)."""
    dst = ops.host_alloc(4 * BLOCK)
    freed = ops.host_alloc(4 * BLOCK)
    span = blocks.memory_span(freed.address)
    ops.host_free(freed)
    try:
        for memory in (span, freed):
            with pytest.raises(pdhal.ClosedHandleError, match="freed"):
                blocks.check_copy(dst, [0], memory, [1], BLOCK)
            with pytest.raises(pdhal.ClosedHandleError, match="freed"):
                ops.copy_blocks(dst, [0], memory, [1], BLOCK)
    finally:
        ops.host_free(dst)


def test_block_bytes_of_a_cache_is_its_bytes_over_its_blocks():
    assert blocks.block_bytes_of(np.zeros((5, 2, 8), dtype=np.float16)) == 32
    with pytest.raises(pdhal.InvalidArgumentError, match="must be a \\[blocks, ...\\] cache"):
        blocks.block_bytes_of(np.zeros(8, dtype=np.uint8), "k cache")


def test_a_span_of_pdhal_memory_is_bounded_by_it_and_holds_it_under_a_copy():
    buf = ops.host_alloc(4 * BLOCK)
    address = buf.address
    try:
        whole = blocks.memory_span(buf.address)
        assert (whole.address, whole.nbytes, whole.device) == (buf.address, 4 * BLOCK, "cpu")
        tail = blocks.memory_span(buf.address + BLOCK, 2 * BLOCK)
        assert tail.nbytes == 2 * BLOCK
        too_long = "does not hold 64 bytes .* \\(it holds 63\\)"
        with pytest.raises(pdhal.InvalidArgumentError, match=too_long):
            blocks.memory_span(buf.address + 1, 4 * BLOCK)
        src = np.full((2, BLOCK), 9, dtype=np.uint8)
        ops.copy_blocks(tail, [1], src, [0], BLOCK)  # block 1 of the tail: block 2 of buf
        written = ctypes.string_at(buf.address, 4 * BLOCK)
        assert written == bytes(2 * BLOCK) + bytes([9]) * BLOCK + bytes(BLOCK)
        with pytest.raises(pdhal.InvalidArgumentError, match="source block id 2"):
            ops.copy_blocks(src, [0], tail, [2], BLOCK)  # past the span, inside buf
    finally:
        ops.host_free(buf)
    with pytest.raises(pdhal.InvalidArgumentError, match="does not lie in memory pdhal"):
        blocks.memory_span(address)
    with pytest.raises(pdhal.ClosedHandleError):
        ops.copy_blocks(tail, [0], src, [0], BLOCK)  # a span of freed memory
