"""A CacheLayout keeps raw addresses of its regions for as long as a KVStreamer or KVReceiver
copies from them: pin() makes a free of that memory a refusal naming who holds it (not a
wait: a streamer may live as long as the process), and the returned unpin lets it go. Ops
on pinned memory run as on any other."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pdhal
from pdhal import ops, transfer
from pdhal._memory import extents as _extents

BLOCKS, BLOCK_BYTES = 4, 64


def layout_over(buffers) -> transfer.CacheLayout:
    return transfer.CacheLayout(
        buffers,
        [[transfer.CacheSpec(i, 0, BLOCK_BYTES, BLOCK_BYTES, BLOCKS)] for i in range(len(buffers))],
    )


def test_a_pinned_layout_s_host_buffers_cannot_be_freed_until_unpinned():
    buffers = [ops.host_alloc(BLOCKS * BLOCK_BYTES) for _ in range(2)]
    layout = layout_over(buffers)
    unpin = layout.pin("KVStreamer")
    with pytest.raises(pdhal.InvalidArgumentError, match="held by KVStreamer: close it first"):
        ops.host_free(buffers[0])
    with pytest.raises(pdhal.InvalidArgumentError, match="held by KVStreamer"):
        buffers[1].close()
    assert not buffers[0].closed and not buffers[1].closed
    buffers[0].as_numpy("uint8", (BLOCKS * BLOCK_BYTES,))[:] = 3  # still mapped, still usable
    unpin()
    unpin()  # twice: harmless
    for buf in buffers:
        ops.host_free(buf)
        assert buf.closed


def test_every_owner_must_unpin_before_the_memory_goes():
    buf = ops.host_alloc(BLOCKS * BLOCK_BYTES)
    layout = layout_over([buf])
    unpin_streamer = layout.pin("KVStreamer")
    unpin_receiver = layout.head_view(0, 1).pin("KVReceiver")
    unpin_streamer()
    with pytest.raises(pdhal.InvalidArgumentError, match="held by KVReceiver: close it first"):
        ops.host_free(buf)
    unpin_streamer()  # a second unpin of one owner leaves the other's pin alone
    with pytest.raises(pdhal.InvalidArgumentError, match="held by KVReceiver"):
        ops.host_free(buf)
    unpin_receiver()
    ops.host_free(buf)


def test_an_array_over_a_host_buffer_pins_the_buffer():
    """numpy does not keep a HostBuffer alive: an array over one (as_numpy) pins the
    buffer it lies in."""
    buf = ops.host_alloc(BLOCKS * BLOCK_BYTES)
    array = buf.as_numpy("uint8", (BLOCKS, BLOCK_BYTES))
    unpin = transfer.CacheLayout.from_caches([[array]]).pin("KVStreamer")
    with pytest.raises(pdhal.InvalidArgumentError, match="held by KVStreamer"):
        ops.host_free(buf)
    unpin()
    ops.host_free(buf)


def test_a_layout_over_python_memory_keeps_it_alive():
    """An array the caller drops lives as long as the layout (nothing for pin to refuse)."""
    layout = transfer.CacheLayout.from_caches([[np.full((BLOCKS, BLOCK_BYTES), 9, np.uint8)]])
    unpin = layout.pin("KVStreamer")
    address, nbytes = layout.regions[0]
    assert bytes(layout.memory[0].tobytes()) == bytes([9]) * nbytes
    assert layout.memory[0].ctypes.data == address
    unpin()


def test_a_pinned_buffer_still_takes_ops():
    src, dst = (ops.host_alloc(BLOCKS * BLOCK_BYTES) for _ in range(2))
    src.as_numpy("uint8", (BLOCKS, BLOCK_BYTES))[:] = np.arange(BLOCKS, dtype=np.uint8)[:, None]
    unpin = layout_over([src, dst]).pin("KVStreamer")
    try:
        assert ops.copy_blocks(dst, [0, 1], src, [3, 2], BLOCK_BYTES) == 2
        landed = dst.as_numpy("uint8", (BLOCKS, BLOCK_BYTES))
        assert landed[0].tolist() == [3] * BLOCK_BYTES and landed[1].tolist() == [2] * BLOCK_BYTES
        assert src._extent.holders == 0 and dst._extent.holders == 0
    finally:
        unpin()
    ops.host_free(src)
    ops.host_free(dst)


def test_pinning_freed_memory_is_refused():
    buf = ops.host_alloc(BLOCKS * BLOCK_BYTES)
    layout = layout_over([buf])
    ops.host_free(buf)
    with pytest.raises(pdhal.ClosedHandleError, match="was freed"):
        layout.pin("KVStreamer")


@pytest.mark.parametrize("owner", ["", None, 3, ["KVStreamer"]])
def test_a_pin_names_its_owner(owner):
    buf = ops.host_alloc(BLOCKS * BLOCK_BYTES)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match="owner must be a non-empty str"):
            layout_over([buf]).pin(owner)
        assert not buf._extent.pins
    finally:
        ops.host_free(buf)


def test_a_refused_retire_retires_nothing():
    """A range registered twice (one mapping named by two objects) goes with either name:
    while the first is pinned, retiring the start address or the second name is refused,
    and both stay usable."""
    with ops.host_alloc(BLOCKS * BLOCK_BYTES) as buf:
        base = buf.address
        again = _extents.register(base, BLOCK_BYTES, "cpu", "a second name")
        pinned = _extents.pin([buf._extent], "KVReceiver")
        with pytest.raises(pdhal.MemoryPinnedError, match="held by KVReceiver"):
            _extents.retire(base)
        with pytest.raises(pdhal.MemoryPinnedError, match="held by KVReceiver"):
            _extents.retire(again)
        assert not buf._extent.retired and not again.retired
        assert _extents.find(base) is again
        _extents.release(_extents.hold([buf._extent, again]))
        _extents.unpin(pinned, "KVReceiver")
        _extents.retire(again)
        assert again.retired and buf._extent.retired


def test_pins_and_unpins_from_many_threads_balance():
    buf = ops.host_alloc(BLOCKS * BLOCK_BYTES)
    layout = layout_over([buf])
    unpins = [layout.pin(f"owner{i % 3}") for i in range(64)]
    go = threading.Barrier(8)

    def let_go(part):
        go.wait()
        for unpin in part:
            unpin()
            unpin()

    threads = [threading.Thread(target=let_go, args=(unpins * 2,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert buf._extent.pins == []
    ops.host_free(buf)
