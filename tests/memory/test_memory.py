"""Host memory, peer addresses and KV-cache buffers shared between processes (cpu backend)."""

from __future__ import annotations

import array
import ctypes
import os
import subprocess

import numpy as np
import pytest

import pdhal
from pdhal import ops
from pdhal.testing.fixtures import python_child, run_child, segments_of


def test_host_alloc_is_usable_pinned_and_freed():
    buf = ops.host_alloc(1 << 20)
    view = buf.as_numpy("uint8", (1 << 20,))
    view[:] = 7
    assert int(view.sum()) == 7 << 20
    assert buf.pinned == pdhal.current_platform().capabilities["pinned_host_memory"]
    ops.cuda_host_free(buf)
    assert buf.closed
    ops.host_free(buf)  # idempotent
    with pytest.raises(pdhal.ClosedHandleError):
        _ = buf.address


@pytest.mark.parametrize("bad", [0, -1, 1 << 50, "10", 1.5, None])
def test_host_alloc_rejects_bad_sizes(bad):
    with pytest.raises(pdhal.PdhalError, match="nbytes"):
        ops.host_alloc(bad)


def test_host_free_rejects_foreign_objects():
    with pytest.raises(pdhal.InvalidTypeError, match="host_alloc"):
        ops.host_free(bytearray(10))


def test_peer_address_of_mapped_memory_is_the_address():
    arr = np.arange(1024, dtype=np.float32)
    assert ops.get_peer_mem_addr(arr) == arr.ctypes.data
    raw = ctypes.create_string_buffer(64)
    assert ops.get_peer_mem_addr(ctypes.addressof(raw)) == ctypes.addressof(raw)


def test_peer_address_of_unmapped_memory_raises():
    with pytest.raises(pdhal.InvalidArgumentError, match="not mapped"):
        ops.get_peer_mem_addr(0x10)
    with pytest.raises(pdhal.InvalidTypeError, match="Paddle tensor"):
        ops.get_peer_mem_addr("0x1000")


@pytest.mark.paddle
def test_paddle_tensor_peer_address():
    import paddle

    t = paddle.arange(16, dtype="int64")
    assert ops.get_peer_mem_addr(t) == t.data_ptr()


def test_kv_buffer_shared_with_another_process_numpy():
    buf = ops.host_alloc(4 * 4096)
    kv = buf.as_numpy("float32", (4, 1024))
    kv[:] = np.arange(4096, dtype=np.float32).reshape(4, 1024)
    ops.set_data_ipc(kv[1:], "kv_layer0")  # starts inside the allocation: offset 4096
    run_child("""
        import numpy as np
        from pdhal import ops
        like = np.zeros(1, dtype=np.float32)
        kv = ops.share_external_data(like, "kv_layer0", [3, 1024])
        assert kv[0, 0] == 1024.0 and kv[2, 1023] == 4095.0, kv[:, :2]
        kv[0, 0] = -1.0  # written through to the owner's memory
    """)
    assert kv[1, 0] == -1.0
    ops.host_free(buf)


@pytest.mark.paddle
def test_kv_buffer_shared_with_another_process_paddle():
    import paddle

    buf = ops.host_alloc(2 * 64 * 2)
    kv = paddle.from_dlpack(buf.as_numpy("float16", (2, 64)))
    kv[:] = 1.5
    ops.set_data_ipc(kv, "kv_cache")
    run_child("""
        import paddle
        from pdhal import ops
        like = paddle.zeros([1], dtype="float16")
        kv = ops.share_external_data(like, "kv_cache", [2, 64])
        assert isinstance(kv, paddle.Tensor) and kv.dtype == paddle.float16
        assert float(kv.sum()) == 1.5 * 128
        kv[1, 63] = 3.0
    """)
    assert float(kv[1, 63]) == 3.0
    ops.host_free(buf)


def test_sharing_memory_pdhal_did_not_allocate_is_refused():
    with pytest.raises(pdhal.UnsupportedError, match="host_alloc"):
        ops.set_data_ipc(np.zeros(16, dtype=np.float32), "kv")


def test_share_external_data_checks_size_and_name():
    buf = ops.host_alloc(1024)
    ops.set_data_ipc(buf.as_numpy("uint8", (1024,)), "small")
    with pytest.raises(pdhal.InvalidArgumentError, match="needs 4096 bytes"):
        ops.share_external_data(np.zeros(1, np.float32), "small", [1024])
    with pytest.raises(pdhal.InvalidArgumentError, match="buffer name"):
        ops.set_data_ipc(buf.as_numpy("uint8", (1024,)), "a/b")
    with pytest.raises(pdhal.InvalidArgumentError, match="buffer name"):
        ops.share_external_data(np.zeros(1, np.float32), "nul\0", [1])
    with pytest.raises(pdhal.SegmentError, match="does not exist"):
        ops.share_external_data(np.zeros(1, np.float32), "missing", [1], timeout=0)
    ops.host_free(buf)


@pytest.mark.paddle
def test_get_output_kv_signal_validates_out():
    chunk = ops.init_kv_signal_per_query([4], [4], [0], 0, 2)
    ops.signal_layer_ready(chunk.layer(0))
    with pytest.raises(pdhal.InvalidArgumentError, match="int32"):
        ops.get_output_kv_signal(np.zeros(1538, np.int64), 0, False)
    with pytest.raises(pdhal.InvalidArgumentError, match="at least 2"):
        ops.get_output_kv_signal(array.array("i", [0]), 0, False)
    with pytest.raises(pdhal.InvalidTypeError, match="writable int32"):
        ops.get_output_kv_signal(None, 0, False)
    short = array.array("i", [0] * 4)  # the record needs 5 words: not consumed
    with pytest.raises(pdhal.InvalidArgumentError, match="holds 4 int32 words"):
        ops.get_output_kv_signal(short, 0, False)
    import paddle

    out = paddle.full([1538], 9, dtype="int32")
    ops.get_output_kv_signal(out, 0, False)
    assert out[:5].tolist() == [1, 0, 0, 0, 4]
    ops.get_output_kv_signal(out, 0, False)  # layer 1 not signalled yet
    assert out[:2].tolist() == [-1, -1]


def test_host_alloc_beyond_ram_is_refused_at_once():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(pdhal.InvalidArgumentError, match="more than this machine's memory"):
        ops.host_alloc(ram + 4096)


def resident_kib(path: str) -> int:
    """Rss of this process's mappings of `path` (mlock splits one into several), from smaps."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.endswith(" " + path)]
    assert starts, f"{path} is not mapped"
    return sum(
        next(int(line.split()[1]) for line in lines[i + 1 :] if line.startswith("Rss:"))
        for i in starts
    )


def test_an_allocation_comes_with_every_page_mapped_and_an_opener_populates_none():
    """A page fault per 4 KiB on first touch made the first copy 4x slower: an allocation
    comes with every page present. Another process's mapping is left to fault in what it
    touches: populating it on a thread of the opener's own froze every thread of a messager
    for 10 to 100 s on a loaded host (its sessions silent past their keepalive)."""
    size = 8 << 20
    with ops.host_alloc(size) as buf:
        assert resident_kib(buf.path) >= size // 1024
        ops.set_data_ipc(buf.as_numpy(np.uint8, (size,)), "kv")
        run_child(
            f"""
            import time
            import numpy as np
            from pdhal import ops
            from test_memory import resident_kib
            ops.share_external_data(np.empty(0, np.uint8), "kv", ({size},))
            time.sleep(0.2)  # (a populate of 8 MiB, were one started, takes milliseconds)
            untouched = resident_kib("{buf.path}")  # nothing here touched its pages
            assert untouched < {size} // 1024 // 2, untouched
        """,
            cwd=os.path.dirname(__file__),
        )


def test_a_view_larger_than_the_buffer_is_refused():
    with ops.host_alloc(4096) as buf:
        with pytest.raises(
            pdhal.InvalidArgumentError, match="needs 8192 bytes, the buffer has 4096"
        ):
            buf.as_numpy("float32", (2048,))


def test_a_shared_tensor_bounds_copies_into_it_not_the_buffer_behind_it():
    """Sharing the first 2 of 4 blocks must not let a copy reach block 3 through the name."""
    buf = ops.host_alloc(4 * 4096)
    try:
        ops.set_data_ipc(buf.as_numpy(np.uint8, (4, 4096))[:2], "half")
        run_child("""
            import numpy as np, pdhal
            from pdhal import ops
            remote = ops.get_data_ptr_ipc(None, "half")
            src = np.ones(4096, np.uint8)
            assert ops.copy_blocks(remote, [1], src, [0], 4096) == 1
            try:
                ops.copy_blocks(remote, [3], src, [0], 4096)
            except pdhal.InvalidArgumentError as e:
                assert "destination block id 3" in str(e), e
            else:
                raise AssertionError("a copy ran past the shared tensor")
        """)
        assert buf.as_numpy(np.uint8, (4, 4096))[:, 0].tolist() == [0, 1, 0, 0]
    finally:
        ops.host_free(buf)


def test_host_memory_never_freed_leaves_no_file_after_a_normal_exit(namespace):
    """An engine never frees its KV cache: at exit its file goes (a forked child exiting
    first leaves its parent's), while a process that mapped it keeps its mapping."""
    holder = python_child(
        """
        import os, sys, threading
        import numpy as np
        from pdhal import ops
        buf = ops.host_alloc(4096)
        kv = buf.as_numpy("uint8", (4096,))
        kv[:] = 7
        # held by a thread still running at exit, as an engine's cache is: never finalized
        threading.Thread(target=lambda held=buf: threading.Event().wait(), daemon=True).start()
        ops.set_data_ipc(kv, "kv_never_freed")
        if os.fork() == 0:
            sys.exit(0)  # a normal exit of a forked child: runs atexit, must keep our file
        os.wait()
        print("ready", flush=True)
        sys.stdin.read()
    """,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "ready\n"
    assert any(".host." in path for path in segments_of(namespace))
    mapper = python_child(
        """
        import sys
        import numpy as np
        from pdhal import ops
        kv = ops.share_external_data(np.zeros(1, np.uint8), "kv_never_freed", [4096])
        print("mapped", flush=True)
        sys.stdin.readline()
        assert (kv == 7).all()
        print("still", flush=True)
    """,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert mapper.stdout.readline() == "mapped\n"
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0
    assert not [path for path in segments_of(namespace) if ".host." in path]
    mapper.stdin.write("\n")
    mapper.stdin.close()
    assert mapper.stdout.readline() == "still\n" and mapper.wait(timeout=30) == 0


@pytest.mark.parametrize(
    "make_ids",
    [
        lambda ids: np.array(ids, np.int64),  # used in place
        lambda ids: np.array(ids, ">i8"),  # the other byte order: converted
        lambda ids: np.repeat(np.array(ids, np.int64), 2)[::2],  # strided: converted
        lambda ids: np.array(ids, np.int32),
    ],
)
def test_copy_blocks_takes_block_ids_as_arrays_and_checks_every_one(make_ids):
    src = np.arange(8 * 16, dtype=np.uint8).reshape(8, 16)
    dst = np.zeros_like(src)
    assert ops.copy_blocks(dst, make_ids([5, 6, 0]), src, make_ids([1, 2, 7]), 16) == 2
    assert (dst[[5, 6, 0]] == src[[1, 2, 7]]).all() and not dst[[1, 2, 3, 4, 7]].any()
    with pytest.raises(pdhal.InvalidArgumentError, match=r"source block id 8 \(entry 1\)"):
        ops.copy_blocks(dst, make_ids([0, 1]), src, make_ids([0, 8]), 16)
