"""Block copies at their edges: which ids coalesce into one copy, the C loop's own checks
(an extent whose size wraps, a runtime copy that fails), and how far memory named by a raw
address extends (an address inside host memory, below every known range, a buffer freed
next to another)."""

from __future__ import annotations

import numpy as np
import pytest
from simulators import SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal._protocol import core as _core
from pdhal.testing.fixtures import run_child

BLOCK = 16


def _caches(blocks: int = 8):
    src = np.arange(blocks * BLOCK, dtype=np.uint8).reshape(blocks, BLOCK)
    return src, np.zeros_like(src)


@pytest.mark.parametrize(
    "dst_ids, src_ids, copies",
    [
        ([0, 1, 2], [5, 3, 4], 2),  # destination consecutive, source not: [0]<-[5], [1, 2]<-[3, 4]
        ([4, 2, 3], [0, 1, 2], 2),  # source consecutive, destination not
        ([6, 7, 1, 2], [2, 3, 5, 6], 2),  # two runs, a gap on both sides between them
        ([3, 4, 5], [3, 4, 5], 1),
    ],
)
def test_only_ids_consecutive_on_both_sides_become_one_copy(dst_ids, src_ids, copies):
    src, dst = _caches()
    assert ops.copy_blocks(dst, dst_ids, src, src_ids, BLOCK) == copies
    assert (dst[dst_ids] == src[src_ids]).all()
    untouched = [b for b in range(8) if b not in dst_ids]
    assert not dst[untouched].any(), "a block that was not named was written"


def test_an_extent_whose_size_wraps_is_refused_by_the_c_loop():
    """pdhal_copy_blocks (pdhal.h, what every backend's copy op calls) refuses extents of
    more bytes than an address space holds, whatever the ids: its bounds check would mean
    nothing."""
    src, dst = _caches(4)
    ids = _core.ffi.new("int64_t[]", [0])
    with pytest.raises(pdhal.InvalidArgumentError, match="do not fit in an address space"):
        _core.copy_blocks(0, 0, 0, dst.ctypes.data, 1 << 61, src.ctypes.data, 4, BLOCK, ids, ids)
    assert not dst.any()


def test_the_c_loop_refuses_a_layer_without_memory_and_too_many_blocks_in_all():
    """pdhal_copy_blocks_layers names the layer whose buffer is missing, and caps the copies
    of all layers together (its return is an int), before anything moves."""
    src, dst = _caches(4)
    ids = _core.ffi.new("int64_t[]", [0, 1])
    with pytest.raises(pdhal.InvalidArgumentError, match="layer 1 of a block copy has no source"):
        _core.copy_blocks(
            0, 0, 0, [dst.ctypes.data] * 2, 4, [src.ctypes.data, 0], 4, BLOCK, ids, ids
        )
    many = _core.ffi.new("int64_t[]", 1 << 20)  # 2**20 ids in each of 2**11 + 1 layers
    layers = (1 << 11) + 1
    with pytest.raises(pdhal.InvalidArgumentError, match="at most 2147483647 blocks in all"):
        _core.copy_blocks(
            0, 0, 0, [dst.ctypes.data] * layers, 4, [src.ctypes.data] * layers, 4, BLOCK, many, many
        )
    assert not dst.any()


@pytest.fixture
def xpu(monkeypatch):
    sim = SimRuntime("xpu", "libxpurt.so")
    monkeypatch.setenv("PDHAL_XPURT", sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
    _registry.reset()
    assert pdhal.current_backend() == "xpu"
    yield sim
    sim.clear_failures()


@pytest.mark.simulated
def test_a_failed_runtime_copy_is_a_device_error_and_stops_the_copies(xpu):
    """The runtime's copy returns its error code (XPUERR_INVALID > 0): the op fails at that
    run with DeviceError naming the code; the runs after it are not issued."""
    stream = xpu.stream()
    src = xpu.device.alloc(4 * BLOCK)
    dst = xpu.device.alloc(4 * BLOCK)
    for block in range(4):
        xpu.launch_write(stream, src.address + block * BLOCK, bytes([block + 1]) * BLOCK, 0)
    xpu.launch_write(stream, dst.address, bytes(4 * BLOCK), 0)
    xpu.fail("xpu_memcpy_async", 1)
    with pytest.raises(pdhal.DeviceError, match=r"failed with code \d+, after 0 copies"):
        ops.copy_blocks(dst, [0, 2], src, [1, 3], BLOCK, stream)  # two runs: the first fails
    assert xpu.failed_calls("xpu_memcpy_async") == 1
    ops.synchronize(stream)
    assert xpu.device.read(dst.address, 4 * BLOCK) == bytes(4 * BLOCK), "a run was copied"
    assert ops.copy_blocks(dst, [0, 2], src, [1, 3], BLOCK, stream) == 2  # the runtime is fine
    ops.synchronize(stream)
    assert xpu.device.read(dst.address, 4 * BLOCK)[::BLOCK] == bytes([2, 0, 4, 0])


def test_an_address_inside_host_memory_extends_to_its_end_only():
    """A raw address into host_alloc'd memory (as engines pass cuda_host_alloc's address
    plus an offset) reaches to the end of that memory, never as far again as its size."""
    src, _ = _caches(4)
    host = ops.host_alloc(4 * BLOCK)
    try:
        view = np.frombuffer(host.memoryview(), np.uint8).reshape(4, BLOCK)
        view[:] = 0
        inside = host.address + BLOCK  # 3 blocks to the end
        with pytest.raises(pdhal.InvalidArgumentError, match=r"destination block id 3 .*0\.\.2"):
            ops.copy_blocks(inside, [3], src, [1], BLOCK)
        assert ops.copy_blocks(inside, [2], src, [1], BLOCK) == 1
        assert (view[3] == src[1]).all() and not view[:3].any()
    finally:
        ops.host_free(host)


KNOWN_RANGES = """
import numpy as np
import pdhal
from pdhal import ops
src = np.arange(64, dtype=np.uint8).reshape(4, 16)
a, b = sorted((ops.host_alloc(64), ops.host_alloc(64)), key=lambda buf: buf.address)
# an address below every range pdhal knows is none of them
try:
    ops.copy_blocks(a.address, [0], 0x1000, [0], 16)
except pdhal.InvalidArgumentError as e:
    assert "did not hand out" in str(e), e
else:
    raise AssertionError("an address below every known range was copied from")
# freeing the lower buffer leaves the upper one known
freed = a.address
ops.host_free(a)
assert ops.copy_blocks(b.address, [3], src, [1], 16) == 1
assert bytes(b.memoryview()[48:64]) == src[1].tobytes()
try:
    ops.copy_blocks(freed, [0], src, [0], 16)
except pdhal.InvalidArgumentError as e:
    assert "did not hand out" in str(e), e
else:
    raise AssertionError("a freed buffer was copied into")
ops.host_free(b)
print("ok")
"""


def test_raw_addresses_are_bounded_by_the_ranges_pdhal_knows_now():
    """In a process of its own, so the ranges pdhal knows are exactly these two buffers."""
    assert run_child(KNOWN_RANGES).stdout == "ok\n"


@pytest.mark.parametrize("side", ["dst", "src"])
def test_a_freed_host_buffer_is_refused_on_either_side(side):
    """pdhal's own buffers describe themselves to every op (no data_ptr round trip); once
    freed, that description is refused, never a copy into or out of freed memory."""
    kept, freed = ops.host_alloc(4 * BLOCK), ops.host_alloc(4 * BLOCK)
    ops.host_free(freed)
    dst, src = (freed, kept) if side == "dst" else (kept, freed)
    with pytest.raises(pdhal.ClosedHandleError, match="host buffer was freed"):
        ops.copy_blocks(dst, [0], src, [1], BLOCK)
    ops.host_free(kept)


def test_a_host_buffer_is_copied_as_the_memory_it_owns():
    """The buffer's own description: its address, its size (a block past it is refused)."""
    with ops.host_alloc(4 * BLOCK) as dst, ops.host_alloc(4 * BLOCK) as src:
        src.memoryview()[:] = bytes(range(4 * BLOCK))
        assert ops.copy_blocks(dst, [3, 0], src, [1, 2], BLOCK) == 2
        view = dst.memoryview()
        assert view[3 * BLOCK : 4 * BLOCK] == bytes(range(BLOCK, 2 * BLOCK))
        assert view[0:BLOCK] == bytes(range(2 * BLOCK, 3 * BLOCK))
        with pytest.raises(pdhal.InvalidArgumentError, match="block id 4"):
            ops.copy_blocks(dst, [4], src, [0], BLOCK)


def test_a_bad_layer_is_named_and_nothing_is_copied():
    src, dst = _caches(4)
    other_dst = np.zeros_like(dst)
    strided = np.zeros(8 * BLOCK, np.uint8)[::2]
    with pytest.raises(pdhal.InvalidArgumentError, match=r"src\[1\] must be contiguous"):
        ops.copy_blocks([dst, other_dst], [0], [src, strided], [1], BLOCK)
    with pytest.raises(pdhal.InvalidArgumentError, match="both lists of memory"):
        ops.copy_blocks([dst], [0], src, [1], BLOCK)
    assert not dst.any() and not other_dst.any()


@pytest.mark.simulated
def test_layers_that_copy_between_different_kinds_of_memory_are_refused(xpu):
    """One call issues one runtime copy kind: a device -> device layer and a host -> device
    layer cannot share it."""
    stream = xpu.stream()
    on_device = [xpu.device.alloc(4 * BLOCK) for _ in range(3)]
    host = ops.host_alloc(4 * BLOCK)
    try:
        with pytest.raises(
            pdhal.InvalidArgumentError, match="same kinds of memory, got cpu -> xpu"
        ):
            ops.copy_blocks(on_device[:2], [0], [on_device[2], host], [1], BLOCK, stream)
    finally:
        ops.host_free(host)
