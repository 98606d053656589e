"""pdhal's behavioural contract (docs/design.md), run against the backend named by --pdhal-backend.

Every op, both signal modes across processes, ordering against device work, sender flush,
shared buffers across processes, peer addresses, host memory, bad inputs, platform facts.
"""

from __future__ import annotations

import array

import numpy as np
import pytest

import pdhal
from pdhal import ops
from pdhal.plugin import BACKEND_OPS
from pdhal.testing.procs import child, finish

STEPS, LAYERS, BLOCK = 20, 8, 64


# ---- platform facts ------------------------------------------------------------------


def test_the_backend_is_selected_and_implements_every_op(backend, pdhal_backend_name):
    assert pdhal.current_backend() == pdhal_backend_name
    table = backend.ops()
    assert sorted(table) == sorted(BACKEND_OPS), (
        f"ops() must name exactly BACKEND_OPS: missing {sorted(set(BACKEND_OPS) - set(table))}, "
        f"unknown {sorted(set(table) - set(BACKEND_OPS))}"
    )
    # pdhal.ops holds the backend's own callables: nothing dispatches on the per-layer path
    for name in BACKEND_OPS:
        assert getattr(ops, name) == table[name], f"pdhal.ops.{name} is not the backend's own"


def test_platform_facts(pdhal_backend_name):
    platform = pdhal.current_platform()
    assert platform.name == pdhal_backend_name, f"Platform.name is {platform.name!r}"
    assert platform.device_control_env_var, "Platform.device_control_env_var is empty"
    assert platform.device_count() >= 1, "an available backend counts at least one device"
    assert isinstance(platform.capabilities, dict), "Platform.capabilities must be a dict"
    env = platform.child_env([platform.physical_device_id(0)], base={})
    assert env == {platform.device_control_env_var: str(platform.physical_device_id(0))}


# ---- signals -------------------------------------------------------------------------


def test_per_query_signals_cross_processes_in_order(support):
    producer = child(
        f"""
        stream = support.stream()
        for step in range({STEPS}):
            meta = ops.open_shm_and_get_meta_signal(0, 0)
            for layer in range({LAYERS}):
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream)
    """,
        hold=True,
    )
    with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
        since = (0, -1)
        while since != (STEPS, LAYERS - 1):
            now = reader.wait(since, timeout=30)
            assert now > since, f"progress went from {since} back to {now}"
            assert now[1] < LAYERS, f"layer {now[1]} was never signalled (only 0..{LAYERS - 1})"
            since = now
    finish(producer)


def test_per_chunk_records_cross_processes_exactly_once_in_order(support):
    producer = child(
        f"""
        stream = support.stream()
        for step in range(1, {STEPS} + 1):
            chunk = ops.init_kv_signal_per_query([step, 0, 7], [step, 0, 7], [3, 0, step],
                                                 0, {LAYERS})
            for layer in range({LAYERS}):
                ops.signal_layer_ready(chunk.layer(layer), stream)
    """,
        hold=True,
    )
    out = array.array("i", [0] * pdhal.RECORD_WORDS)
    for step in range(1, STEPS + 1):
        for layer in range(LAYERS):
            ops.get_output_kv_signal(out, 0, True, timeout=30)
            assert list(out[:8]) == [2, layer, 0, 3, step, 2, step, 7], (
                f"record {list(out[:8])} where step {step} layer {layer} was expected"
            )
    finish(producer)


def test_draft_model_keeps_the_step():
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 3))
    draft = ops.open_shm_and_get_meta_signal(0, 0, keep_pd_step_flag=True)
    ops.signal_layer_ready(ops.init_signal_layerwise(draft, LAYERS))
    with ops.open_kv_signal_reader(0, 0) as reader:
        got = reader.wait((meta.step, 3), timeout=10)
        assert got == (meta.step, LAYERS), f"the draft layer gave {got}, not (step, {LAYERS})"


@pytest.mark.parametrize("through", ["default", "sender"])
def test_a_layer_is_signalled_only_after_the_work_before_it(support, through):
    """The device ordering guarantee, checked from another process through shared memory."""
    kv = support.alloc(LAYERS * BLOCK)
    ops.set_data_ipc(kv, "kit_kv")
    checker = child(f"""
        import numpy as np
        shared = ops.share_external_data(np.zeros(1, np.uint8), "kit_kv", [{LAYERS * BLOCK}])
        address = support.shared_address(shared)
        with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
            since = (1, -1)
            while since[1] < {LAYERS} - 1:
                since = reader.wait(since, timeout=30)
                for layer in range(since[1] + 1):
                    got = support.read(address + layer * {BLOCK}, {BLOCK})
                    assert got == bytes([layer + 1]) * {BLOCK}, (
                        f"layer {{layer}} was signalled ({{since}}) before its write landed")
    """)
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    stream = support.stream()
    sender = ops.create_kv_signal_sender() if through == "sender" else None
    for layer in range(LAYERS):
        support.delayed_write(stream, kv.address + layer * BLOCK, bytes([layer + 1]) * BLOCK, 20000)
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream, sender)
    if support.asynchronous:
        with ops.open_kv_signal_reader(0, 0) as reader:
            assert reader.current() == (meta.step, -1), "a signal overtook the first write"
    if sender is not None:
        ops.destroy_kv_signal_sender(sender)
    finish(checker)


def test_destroying_a_sender_delivers_everything_pending(support):
    kv = support.alloc(BLOCK)
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    stream = support.stream()
    with ops.create_kv_signal_sender() as sender:
        support.delayed_write(stream, kv.address, b"x" * BLOCK, 100000)
        for layer in range(500):
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream, sender)
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (1, 499), (
            f"destroy returned with signals undelivered: progress {reader.current()}"
        )
    assert sender.closed, "a sender is closed after its with-block"


# ---- memory --------------------------------------------------------------------------


def test_shared_buffer_is_the_same_bytes_in_another_process(support):
    kv = support.alloc(4 * BLOCK)
    support.delayed_write(support.stream(), kv.address + BLOCK, b"shared!", 0)
    ops.set_data_ipc(kv, "kit_shared")
    reader = child(f"""
        import numpy as np, time
        shared = ops.share_external_data(np.zeros(1, np.uint8), "kit_shared", [{4 * BLOCK}])
        address = support.shared_address(shared)
        deadline = time.monotonic() + 10
        while support.read(address + {BLOCK}, 7) != b"shared!":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    """)
    finish(reader)


def test_share_external_data_refuses_more_than_was_shared(support):
    ops.set_data_ipc(support.alloc(BLOCK), "kit_small")
    with pytest.raises(pdhal.InvalidArgumentError, match="needs"):
        ops.share_external_data(np.zeros(1, np.float32), "kit_small", [BLOCK])
    with pytest.raises(pdhal.SegmentError):
        ops.share_external_data(np.zeros(1, np.float32), "kit_missing", [1], timeout=0)


def test_peer_address_of_device_memory_is_an_int(support):
    kv = support.alloc(BLOCK)
    assert isinstance(ops.get_peer_mem_addr(kv), int)


def test_peer_address_of_host_alloc_memory_is_its_own():
    """A transport registers a staged cache's pinned host memory with its NIC (Mooncake
    over TCP serves host memory only): on every backend that is the memory's address."""
    buf = ops.host_alloc(1 << 16)
    try:
        assert ops.get_peer_mem_addr(buf) == buf.address
    finally:
        ops.host_free(buf)


def test_host_memory_roundtrip():
    buf = ops.host_alloc(1 << 16)
    buf.as_numpy("uint8", (1 << 16,))[:] = 5
    assert buf.memoryview()[100] == 5
    ops.host_free(buf)
    ops.host_free(buf)  # idempotent
    assert buf.closed
    with pytest.raises(pdhal.ClosedHandleError):
        _ = buf.address


def test_a_signal_in_kernel_form_posts_like_the_signal(support):
    """What a device op receives (int64 words) is accepted back by signal_layer_ready."""
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    words = np.frombuffer(ops.init_signal_layerwise(meta, 4).kernel_form, np.int64)
    ops.signal_layer_ready(words, support.stream())
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.wait((meta.step, -1), timeout=10) == (meta.step, 4)
    with pytest.raises(pdhal.InvalidArgumentError, match="not a layer signal"):
        ops.signal_layer_ready(np.array([7, 0, 0, 0], np.int64))


# ---- block copies ----------------------------------------------------------------------


def _filled(support, blocks: int, stream):
    """Device memory of `blocks` blocks, block i filled with byte i + 1 by work on `stream`."""
    kv = support.alloc(blocks * BLOCK)
    for i in range(blocks):
        support.delayed_write(stream, kv.address + i * BLOCK, bytes([i + 1]) * BLOCK, 0)
    return kv


def _blocks_of(support, address: int, blocks: int) -> list[int]:
    """The first byte of each block (each block is uniform in these tests)."""
    data = support.read(address, blocks * BLOCK)
    assert all(
        data[i * BLOCK : (i + 1) * BLOCK] == bytes([data[i * BLOCK]]) * BLOCK for i in range(blocks)
    ), "a block was written partly"
    return [data[i * BLOCK] for i in range(blocks)]


def test_block_copies_move_exactly_the_named_blocks_in_stream_order(support):
    stream = support.stream()
    src = _filled(support, 8, stream)  # the copy is queued behind these writes
    dst = support.alloc(8 * BLOCK)
    copies = ops.copy_blocks(dst, [5, 6, 7, 0], src, [1, 2, 3, 4], BLOCK, stream)
    ops.synchronize(stream)
    assert copies == 2, f"{copies} copies: 1..3 -> 5..7 is one run and 4 -> 0 another"
    got = _blocks_of(support, dst.address, 8)
    assert got == [5, 0, 0, 0, 0, 2, 3, 4], f"blocks of the destination: {got}"


def test_block_copies_between_host_and_device(support):
    stream = support.stream()
    src = _filled(support, 4, stream)
    host = ops.host_alloc(4 * BLOCK)
    host.memoryview()[:] = bytes(4 * BLOCK)  # host_alloc promises no contents
    try:
        ops.copy_blocks(host.address, [3, 2], src, [0, 1], BLOCK, stream)  # device -> host
        ops.synchronize(stream)
        assert list(host.memoryview()[::BLOCK]) == [0, 0, 2, 1]
        dst = support.alloc(4 * BLOCK)
        ops.copy_blocks(dst, [0, 1], host, [2, 3], BLOCK, stream)  # host -> device
        ops.synchronize(stream)
        assert _blocks_of(support, dst.address, 4) == [2, 1, 0, 0]
    finally:
        ops.host_free(host)


@pytest.mark.parametrize(
    "dst_ids, src_ids, words",
    [
        ([0, 4], [0, 1], "destination block id 4"),
        ([0, 1], [0, -1], "source block id -1"),
        ([0, 1], [0], "must pair up"),
        ([0, "1"], [0, 1], "integer block ids"),
    ],
)
def test_bad_block_ids_are_refused_and_nothing_is_copied(support, dst_ids, src_ids, words):
    stream = support.stream()
    src = _filled(support, 4, stream)
    dst = support.alloc(4 * BLOCK)
    with pytest.raises(pdhal.InvalidArgumentError, match=words):
        ops.copy_blocks(dst, dst_ids, src, src_ids, BLOCK, stream)
    ops.synchronize(stream)
    assert _blocks_of(support, dst.address, 4) == [0, 0, 0, 0], "a refused copy wrote blocks"


def test_a_copy_of_several_layers_moves_the_same_blocks_in_each(support):
    """copy_blocks with lists of memory: layer l of dst receives from layer l of src, the
    same ids in each, in stream order."""
    stream = support.stream()
    srcs = [support.alloc(4 * BLOCK) for _ in range(3)]
    for layer, src in enumerate(srcs):  # block i of layer l holds 10 * l + i + 1
        for i in range(4):
            fill = bytes([10 * layer + i + 1]) * BLOCK
            support.delayed_write(stream, src.address + i * BLOCK, fill, 0)
    dsts = [support.alloc(4 * BLOCK) for _ in range(3)]
    copies = ops.copy_blocks(dsts, [2, 3, 0], srcs, [0, 1, 3], BLOCK, stream)
    ops.synchronize(stream)
    assert copies == 6, f"{copies} copies: two runs in each of three layers"
    for layer, dst in enumerate(dsts):
        got = _blocks_of(support, dst.address, 4)
        base = 10 * layer
        assert got == [base + 4, 0, base + 1, base + 2], f"layer {layer}: {got}"


def test_an_id_past_one_layer_of_several_is_refused_in_every_layer(support):
    """The ids are checked against the smallest layer before the first byte of any layer
    moves: a bad id for the last layer leaves the first ones unwritten too."""
    stream = support.stream()
    srcs = [_filled(support, 4, stream) for _ in range(2)]
    dsts = [support.alloc(4 * BLOCK), support.alloc(2 * BLOCK)]
    with pytest.raises(pdhal.InvalidArgumentError, match="destination block id 3"):
        ops.copy_blocks(dsts, [0, 3], srcs, [0, 1], BLOCK, stream)
    with pytest.raises(pdhal.InvalidArgumentError, match="pair up layer by layer"):
        ops.copy_blocks(dsts, [0], srcs[:1], [0], BLOCK, stream)
    ops.synchronize(stream)
    assert _blocks_of(support, dsts[0].address, 4) == [0, 0, 0, 0], "layer 0 was written"
    assert _blocks_of(support, dsts[1].address, 2) == [0, 0], "layer 1 was written"


def test_blocks_land_in_another_process_s_shared_cache(support):
    """A same-host transfer: the receiver publishes its cache, the sender maps it by name
    (get_data_ptr_ipc) and copies named blocks into it; nothing else changes."""
    receiver = child(
        f"""
        import sys
        kv = support.alloc({8 * BLOCK})
        ops.set_data_ipc(kv, "kit_remote")
        print("published", flush=True)
        sys.stdin.readline()  # the sender is done
        got = [support.read(kv.address + i * {BLOCK}, {BLOCK}) for i in range(8)]
        assert got == [bytes([b]) * {BLOCK} for b in (0, 0, 3, 4, 0, 0, 0, 2)], got
    """,
        stdin=-1,
        stdout=-1,
        text=True,
    )
    assert receiver.stdout.readline() == "published\n"
    stream = support.stream()
    src = _filled(support, 4, stream)
    remote = ops.get_data_ptr_ipc(None, "kit_remote", timeout=30)
    assert isinstance(remote, int)
    ops.copy_blocks(remote, [7, 2, 3], src, [1, 2, 3], BLOCK, stream)
    ops.synchronize(stream)
    receiver.stdin.write("done\n")
    receiver.stdin.flush()
    finish(receiver)


def test_unset_data_ipc_takes_the_record_away(support):
    kv = support.alloc(BLOCK)
    ops.set_data_ipc(kv, "kit_unset")
    assert ops.share_external_data(np.zeros(1, np.uint8), "kit_unset", [BLOCK]) is not None
    ops.unset_data_ipc(kv, "kit_unset")
    with pytest.raises(pdhal.SegmentError, match="does not exist"):
        ops.share_external_data(np.zeros(1, np.uint8), "kit_unset", [BLOCK], timeout=0)
    with pytest.raises(pdhal.InvalidArgumentError, match="no buffer is shared as 'kit_unset'"):
        ops.unset_data_ipc(kv, "kit_unset")


def test_host_register_makes_memory_known_and_unregister_forgets_it(support):
    stream = support.stream()
    src = _filled(support, 2, stream)
    host = np.zeros(2 * BLOCK, np.uint8)
    ops.host_register(host)
    try:
        ops.copy_blocks(host.ctypes.data, [0], src, [1], BLOCK, stream)  # a raw address: known
        ops.synchronize(stream)
        assert host[0] == 2 and host[BLOCK] == 0
    finally:
        ops.host_unregister(host)
    with pytest.raises(pdhal.InvalidArgumentError, match="did not hand out"):
        ops.copy_blocks(host.ctypes.data, [0], src, [1], BLOCK, stream)
    with pytest.raises(pdhal.InvalidArgumentError, match="was not registered"):
        ops.host_unregister(host)


# ---- bad inputs ----------------------------------------------------------------------

BAD_CALLS = [
    ("open_shm_and_get_meta_signal", (-1, 0)),
    ("open_shm_and_get_meta_signal", (0, "0")),
    ("init_signal_layerwise", (None, 0)),
    ("init_kv_signal_per_query", ([1], [1, 2], [0], 0, 4)),
    ("init_kv_signal_per_query", ([-1], [1], [0], 0, 4)),
    ("init_kv_signal_per_query", ([1], [1], [0], 0, 0)),
    ("init_kv_signal_per_query", ("abc", [1], [0], 0, 4)),
    ("signal_layer_ready", (object(),)),
    ("destroy_kv_signal_sender", (object(),)),
    ("get_output_kv_signal", (np.zeros(4, np.float64), 0, False)),
    ("host_alloc", (0,)),
    ("host_alloc", (-5,)),
    ("host_alloc", (1 << 60,)),
    ("host_free", (b"bytes",)),
    ("get_peer_mem_addr", ("0x10",)),
    ("get_peer_mem_addr", (0,)),
    ("set_data_ipc", (12345, "kv")),
    ("share_external_data", (object(), "kv", [1])),
    ("share_external_data", (np.zeros(1), "a/b", [1])),
    ("share_external_data", (np.zeros(1), "nul\0", [1])),
    ("share_external_data", (np.zeros(1), "kv", [-1])),
    ("copy_blocks", (np.zeros(8, np.uint8), [0], np.zeros(8, np.uint8), [0], 0)),
    ("copy_blocks", (np.zeros(8, np.uint8), [0], 12345, [0], 8)),
    ("copy_blocks", (np.zeros(8, np.uint8), "0", np.zeros(8, np.uint8), [0], 8)),
    ("unset_data_ipc", (np.zeros(1), "a/b")),
    ("host_unregister", (np.zeros(8, np.uint8),)),
    ("get_data_ptr_ipc", (None, "kit_never_shared", 0)),
]


@pytest.mark.parametrize(
    "op,args", BAD_CALLS, ids=[f"{op}-{i}" for i, (op, _) in enumerate(BAD_CALLS)]
)
def test_bad_input_is_a_pdhal_error_that_says_what_was_expected(op, args):
    with pytest.raises(pdhal.PdhalError) as info:
        getattr(ops, op)(*args)
    assert len(str(info.value)) > 20  # a sentence, not a bare code


def test_a_closed_reader_is_refused():
    ops.open_shm_and_get_meta_signal(0, 0)
    reader = ops.open_kv_signal_reader(0, 0)
    reader.close()
    with pytest.raises(pdhal.ClosedHandleError):
        reader.current()
