"""The copier (copier.c): host copies into a destination's regions, checked whole when posted,
run in order on a C thread of their own; and the doorbell its users wait on."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pdhal import InvalidArgumentError, TransferError
from pdhal._protocol import core
from pdhal._transfer.layout import LayerCopies, PieceCopies, UnitCopies
from pdhal.testing.fixtures import run_child


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


def _assert_landed_as_planned(regions, source, copies) -> None:
    """`regions` hold exactly what `copies` (address, region, offset, bytes) from
    `source` put into zeroed regions of their sizes."""
    expected = [np.zeros_like(region) for region in regions]
    src = _address(source)
    for address, region, offset, nbytes in copies:
        at = address - src
        expected[region][offset : offset + nbytes] = source[at : at + nbytes]
    for got, want in zip(regions, expected):
        assert np.array_equal(got, want)


@pytest.fixture
def memory():
    """Two destination regions and one source, with the copier over them."""
    regions = [np.zeros(4096, np.uint8), np.zeros(1024, np.uint8)]
    source = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    copier = core.Copier(
        [_address(r) for r in regions], [r.nbytes for r in regions], [(_address(source), 4096)]
    )
    yield regions, source, copier
    copier.destroy()


def test_runs_land_in_the_order_they_were_posted(memory):
    regions, source, copier = memory
    src = _address(source)
    jobs = [copier.post_runs([(src + 64 * i, 0, 0, 64)]) for i in range(50)]
    jobs[-1].wait(30)
    assert all(job.done() for job in jobs)  # a job runs only after those before it
    assert bytes(regions[0][:64]) == bytes(source[49 * 64 : 50 * 64])


def test_one_job_copies_into_several_regions(memory):
    regions, source, copier = memory
    src = _address(source)
    copier.post_runs([(src, 0, 100, 10), (src + 10, 1, 1014, 10)]).wait(30)
    assert bytes(regions[0][100:110]) == bytes(source[:10])
    assert bytes(regions[1][1014:]) == bytes(source[10:20])


@pytest.mark.parametrize(
    "run, words",
    [
        ((0, 2, 0, 1), "outside the destination"),  # no region 2
        ((0, 1, 1020, 5), "outside the destination"),  # past region 1's end
        ((0, 1, 1 << 63, 1), "outside the destination"),  # an offset that would wrap
        ((-64, 0, 0, 64), "outside the memory"),  # before the source
        ((4090, 0, 0, 8), "outside the memory"),  # past the source's end
    ],
)
def test_a_run_outside_what_the_copier_may_touch_is_refused_whole(memory, run, words):
    regions, source, copier = memory
    src, region, offset, nbytes = run
    good = (_address(source), 0, 0, 8)
    with pytest.raises(TransferError, match=words):
        copier.post_runs([good, (_address(source) + src, region, offset, nbytes)])
    assert not regions[0][:8].any()  # the good run of that post never ran


def test_a_run_of_no_bytes_is_refused(memory):
    _, source, copier = memory
    with pytest.raises(InvalidArgumentError, match="0 bytes"):
        copier.post_runs([(_address(source), 0, 0, 0)])


@pytest.mark.parametrize("source_stride, dest_stride", [(64, 64), (128, 64), (64, 96)])
def test_block_runs_expand_to_the_copies_python_plans(memory, source_stride, dest_stride):
    """post_blocks expands (source block, destination block, count) runs in C into the very
    copies LayerCopies.copies plans in Python (one per run where strides are the block
    size, else one per block), in two caches of one layer."""
    regions, source, copier = memory
    src = _address(source)
    layer = LayerCopies(
        [(src, source_stride, 0, 0, dest_stride, 64), (src + 2048, source_stride, 1, 0, 64, 64)]
    )
    runs = [(0, 3, 2), (5, 0, 1), (3, 8, 3)]
    copier.post_blocks(layer.caches, layer.count, core.block_run_words(runs), len(runs)).wait(30)
    _assert_landed_as_planned(regions, source, layer.copies(runs))


@pytest.mark.parametrize("units, heads", [((3, 2), 1), ((2, 3), 2), ((4, 1), 2), ((1, 4), 1)])
def test_unit_runs_expand_to_the_copies_python_plans(memory, units, heads):
    """post_units expands unit runs between caches of two block sizes in C into the very
    copies UnitCopies.copies plans in Python (per head, per stretch inside one block on
    both sides), in two caches of one layer."""
    regions, source, copier = memory
    src = _address(source)
    unit = 16 * heads  # a unit's bytes, every head
    s_block, d_block = unit * units[0], unit * units[1]
    layer = UnitCopies(
        [(src, s_block, 0, 0, d_block, unit), (src + 2048, s_block, 1, 0, d_block, unit)],
        [heads, heads],
        *units,
    )
    runs = [(0, 3, 5), (7, 0, 2), (4, 9, 3)]
    copier.post_units(
        layer.caches, layer.heads, layer.count, layer.units, core.block_run_words(runs), 3
    ).wait(30)
    _assert_landed_as_planned(regions, source, layer.copies(runs))


@pytest.mark.parametrize("orders", [("tokens", "heads"), ("heads", "tokens"), ("tokens", "tokens")])
@pytest.mark.parametrize("tokens, parts", [((4, 4), 3), ((3, 2), 2), ((2, 5), 1)])
def test_token_runs_between_two_orders_expand_to_the_copies_python_plans(
    memory, orders, tokens, parts
):
    """post_pieces expands token runs between caches ordered differently inside a block
    (token-major against head-major), or token-major ones of two block sizes, in C into
    the very copies PieceCopies.copies plans in Python (per token per part, or per
    stretch where both sides are token-major), in two caches of one layer."""
    regions, source, copier = memory
    src = _address(source)
    token = 8 * parts  # a token's bytes, every part
    s_block, d_block = token * tokens[0], token * tokens[1]
    layer = PieceCopies(
        [(src, s_block, 0, 0, d_block, token), (src + 2048, s_block, 1, 0, d_block, token)],
        [parts, parts],
        [orders, orders],
        *tokens,
    )
    runs = [(0, 3, 5), (7, 0, 2), (5, 9, 3)]
    copier.post_pieces(
        layer.caches, layer.heads, layer.orders, layer.count, layer.units,
        core.block_run_words(runs), 3,
    ).wait(30)  # fmt: skip
    _assert_landed_as_planned(regions, source, layer.copies(runs))


@pytest.mark.parametrize("orders", [("heads", "tokens"), ("tokens", "heads")])
def test_a_grid_whose_later_rows_pass_a_region_s_end_is_refused_whole(memory, orders):
    """Between two orders a stretch is rows of copies (a token's parts, or a part's
    tokens): its destination block at the last 32 bytes of a 1,024-byte region, the first
    row fits and the last does not; refused before any copy, the region untouched."""
    regions, source, copier = memory
    layer = PieceCopies([(_address(source), 64, 1, 992, 64, 16)], [2], [orders], 4, 4)
    with pytest.raises(TransferError, match="outside the destination"):
        copier.post_pieces(
            layer.caches, layer.heads, layer.orders, layer.count, layer.units,
            core.block_run_words([(0, 0, 4)]), 1,
        )  # fmt: skip
    assert not regions[1].any()


def test_an_order_mask_that_is_not_one_is_refused(memory):
    regions, source, copier = memory
    caches = core.copy_caches([(_address(source), 32, 1, 0, 32, 16)])
    with pytest.raises(InvalidArgumentError, match="cache 0's order is 4"):
        copier.post_pieces(
            caches, core.head_counts([2]), core.order_masks([4]), 1, (2, 2),
            core.block_run_words([(0, 0, 1)]), 1,
        )  # fmt: skip
    assert not regions[1].any()


@pytest.mark.parametrize(
    "heads, units, runs, error, words",
    [
        ([3], (2, 1), [(0, 0, 1)], TransferError, "not whole heads"),
        ([1], (0, 1), [(0, 0, 1)], InvalidArgumentError, "each from 1 to 2\\^24"),
        ([1], (2, 1), [(0, 0, 65)], TransferError, "no more than region 1 holds \\(64\\)"),
        ([1], (2, 1), [(0, -1, 1)], TransferError, "ids from 0"),
        ([1], (2, 1), [(0, 63, 2)], TransferError, "outside the destination"),
    ],
)
def test_unit_runs_that_do_not_fit_are_refused_before_any_copy(
    memory, heads, units, runs, error, words
):
    regions, source, copier = memory
    caches = core.copy_caches([(_address(source), 32, 1, 0, 16, 16)])
    with pytest.raises(error, match=words):
        copier.post_units(
            caches, core.head_counts(heads), 1, units, core.block_run_words(runs), len(runs)
        )
    assert not regions[1].any()


def test_block_runs_past_a_region_are_refused_before_any_copy(memory):
    regions, source, copier = memory
    layer = LayerCopies([(_address(source), 64, 1, 0, 64, 64)])
    runs = core.block_run_words([(0, 0, 1), (0, 15, 2)])  # blocks 15 and 16 of 16
    with pytest.raises(TransferError, match="outside the destination"):
        copier.post_blocks(layer.caches, layer.count, runs, 2)
    assert not regions[1].any()


def test_a_source_its_caller_unmapped_fails_the_job_not_the_process():
    """A source that was readable when the copier was made, made unreadable by its caller
    since (PROT_NONE: a page unmapped faults the same way, but its address may be mapped
    again by anyone meanwhile, AddressSanitizer's allocator among them): the copier thread
    meets SIGSEGV, that job fails naming it, and the copier goes on with the next (in a
    child: a fault that is not caught ends it)."""
    run_child(
        """
import ctypes
import numpy as np
from pdhal import TransferError
from pdhal._protocol import core
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = 4096
pages = libc.mmap(None, 2 * PAGE, 3, 0x22, -1, 0)  # read/write, private, anonymous
ctypes.memset(pages, 1, 2 * PAGE)
region, other = np.zeros(PAGE, np.uint8), np.full(PAGE, 3, np.uint8)
copier = core.Copier(
    [region.ctypes.data], [PAGE], [(pages, 2 * PAGE), (other.ctypes.data, PAGE)]
)
assert libc.mprotect(pages, 2 * PAGE, 0) == 0
for source, nbytes in ((pages, 64), (pages + PAGE - 32, 64), (pages + 100, 3000)):
    job = copier.post_runs([(source, 0, 0, nbytes)])
    try:
        job.wait(30)
    except TransferError as e:
        assert "unmapped or protected memory (SIGSEGV)" in str(e), e
    else:
        raise AssertionError("a copy from memory no longer readable was done")
copier.post_runs([(other.ctypes.data, 0, 0, PAGE)]).wait(30)  # the next job runs
assert (region == 3).all()
copier.destroy()
"""
    )


def test_a_destination_its_owner_shrank_fails_the_job_not_the_process(tmp_path):
    """A peer truncates the file behind the mapped region: the copier thread meets SIGBUS,
    that job fails naming it, and the copier goes on with the next."""
    path = tmp_path / "region"
    path.write_bytes(bytes(2 * mmap.PAGESIZE))
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 2 * mmap.PAGESIZE)
    window = ctypes.c_char.from_buffer(mapped)
    source, other = np.ones(2 * mmap.PAGESIZE, np.uint8), np.zeros(16, np.uint8)
    copier = core.Copier(
        [ctypes.addressof(window), _address(other)],
        [2 * mmap.PAGESIZE, 16],
        [(_address(source), source.nbytes)],
    )
    try:
        copier.post_runs([(_address(source), 0, 0, 16)]).wait(30)
        assert mapped[:16] == bytes([1] * 16)
        path.write_bytes(b"")  # truncated under the mapping
        job = copier.post_runs([(_address(source), 0, mmap.PAGESIZE, 16)])
        with pytest.raises(TransferError, match="SIGBUS"):
            job.wait(30)
        assert job.done()
        copier.post_runs([(_address(source), 1, 0, 16)]).wait(30)  # the next job runs
        assert other.all()
    finally:
        copier.destroy()
        del window
        mapped.close()


def test_destroy_runs_what_was_posted_then_refuses_more(memory):
    regions, source, copier = memory
    jobs = [copier.post_runs([(_address(source), 0, 0, 4096)]) for _ in range(20)]
    copier.destroy()
    assert all(job.done() for job in jobs)  # drained, not dropped
    assert bytes(regions[0]) == bytes(source)
    with pytest.raises(TransferError, match="closed"):
        copier.post_runs([(_address(source), 0, 0, 8)])
    copier.destroy()  # idempotent


FORKED = """
import os, sys
import numpy as np
from pdhal import TransferError
from pdhal._protocol import core
region, source = np.zeros(64, np.uint8), np.ones(64, np.uint8)
copier = core.Copier([region.ctypes.data], [64], [(source.ctypes.data, 64)])
copier.post_runs([(source.ctypes.data, 0, 0, 8)]).wait(30)
pid = os.fork()
if pid == 0:
    try:
        copier.post_runs([(source.ctypes.data, 0, 0, 8)])
    except TransferError as e:
        print("refused:", e, flush=True)
        os._exit(0)
    print("posted", flush=True)
    os._exit(1)
_, status = os.waitpid(pid, 0)
copier.post_runs([(source.ctypes.data, 0, 8, 8)]).wait(30)  # the parent's goes on
print("parent", bytes(region[:16]) == bytes(16 * [1]), flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_is_refused_the_parents_copier():
    """The copier's thread exists only in the process that started it: a post from a fork
    would queue a job nothing runs; it is refused, naming why."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "forked child must connect its own link" in done.stdout
    assert "parent True" in done.stdout


def test_a_bell_wait_ends_at_its_timeout_or_a_ring():
    bell = core.Bell()
    seen = bell.seen()
    waited = []  # in a thread of its own: a wait that ignored its timeout fails, not hangs
    waiter = threading.Thread(target=lambda: waited.append(bell.wait(seen, 0.01)), daemon=True)
    waiter.start()
    waiter.join(30)
    assert waited == [False]
    ringer = threading.Timer(0.05, bell.ring)
    ringer.start()
    assert bell.wait(seen, 30) is True
    ringer.join()
    assert bell.seen() != seen


def test_a_ring_between_looking_and_waiting_is_not_missed():
    """A waiter reads seen(), then (as if descheduled) a ring comes before it waits: its
    wait returns at once, however long it would have waited."""
    bell = core.Bell()
    seen = bell.seen()
    bell.ring()
    assert bell.wait(seen, 5) is True  # a missed ring: False, after 5 s


def test_a_job_is_done_only_once_its_last_copy_ran():
    """A waiter woken by the job sees every byte of it, the last copy's (the largest) too."""
    nbytes = 32 << 20
    region, source = np.zeros(nbytes, np.uint8), np.full(nbytes, 5, np.uint8)
    copier = core.Copier([_address(region)], [nbytes], [(_address(source), nbytes)])
    try:
        for _ in range(3):
            region[:] = 0
            job = copier.post_runs(
                [(_address(source), 0, 0, 8), (_address(source), 0, 8, nbytes - 8)]
            )
            job.wait(30)
            assert region[-(1 << 20) :].all() and region[:8].all()
    finally:
        copier.destroy()


@pytest.mark.parametrize(
    "blocks, stride",
    [(1 << 40, 64), (17, 64), (1 << 40, 128), (17, 128)],
    ids=["whole-huge", "whole-one-past", "strided-huge", "strided-one-past"],
)
def test_a_run_of_more_blocks_than_its_region_holds_is_refused_before_it_is_counted(
    memory, blocks, stride
):
    """Region 1 holds 16 blocks of 64 bytes: a run of more is outside it, refused naming
    the run (not 'out of memory' for 2**40 copies, nor a count that wraps)."""
    regions, source, copier = memory
    layer = LayerCopies([(_address(source), stride, 1, 0, stride, 64)])
    with pytest.raises(TransferError, match="outside the destination"):
        copier.post_blocks(layer.caches, 1, core.block_run_words([(0, 0, blocks)]), 1)
    assert not regions[1].any()


REPLACED_HANDLER = """
import ctypes, mmap, os, signal, tempfile
import numpy as np
from pdhal import TransferError
from pdhal._protocol import core
path = tempfile.mktemp()
with open(path, "wb") as f:
    f.write(bytes(2 * mmap.PAGESIZE))
with open(path, "r+b") as f:
    mapped = mmap.mmap(f.fileno(), 2 * mmap.PAGESIZE)
window = ctypes.c_char.from_buffer(mapped)
source = np.ones(mmap.PAGESIZE, np.uint8)
copier = core.Copier([ctypes.addressof(window)], [2 * mmap.PAGESIZE], [(source.ctypes.data, 4096)])
copier.post_runs([(source.ctypes.data, 0, 0, 16)]).wait(30)  # the guard's handler installed
signal.signal(signal.SIGBUS, lambda *_: None)  # a library's own, as paddle's import installs
os.truncate(path, 0)
try:
    copier.post_runs([(source.ctypes.data, 0, mmap.PAGESIZE, 16)]).wait(30)
except TransferError as e:
    print("failed:", e)
copier.destroy()
os.unlink(path)
"""


def test_a_sigbus_handler_installed_after_the_first_copy_does_not_unguard_the_next():
    """Paddle's import installs its own SIGBUS handler; one installed after the copier's
    first job replaced the guard's, and a shrunk destination then ended the process (or, a
    handler that returns, faulted forever). The copier installs the guard again."""
    done = subprocess.run(
        [sys.executable, "-c", REPLACED_HANDLER], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failed:" in done.stdout and "SIGBUS" in done.stdout


# ---- gates: jobs held until a layer's signal (KVStreamer.follow) ------------------------


@pytest.fixture
def channel():
    """The engine's per-query channel (this process produces it: step 1 begun) and its
    reader, whose segment a gate waits on."""
    from pdhal import ops
    from pdhal._protocol import signals

    meta = ops.open_shm_and_get_meta_signal(0, 0)
    reader = ops.open_kv_signal_reader(0, 0, timeout=30)
    yield meta, reader
    reader.close()
    signals.close_producer_channels()


def _until(step: int, layer: int) -> int:
    return (step << core.LAYER_BITS) | (layer + 1)


def test_a_gate_holds_the_jobs_behind_it_until_its_layer_is_signalled(memory, channel):
    from pdhal import ops

    regions, source, copier = memory
    meta, reader = channel
    gate = copier.post_gate(reader.segment, _until(1, 1), 30)
    job = copier.post_runs([(_address(source), 0, 0, 64)])
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))  # not its layer yet
    with pytest.raises(TransferError, match="did not run within"):
        job.wait(0.2)
    assert not gate.done() and gate.started_ns() == 0 and not regions[0].any()
    signalled = time.monotonic_ns()
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1))
    job.wait(30)
    assert bytes(regions[0][:64]) == bytes(source[:64])
    assert signalled <= gate.started_ns() <= job.started_ns()


def test_a_gate_whose_signal_does_not_come_fails_with_the_job_it_guards_only(memory, channel):
    from pdhal import ops

    regions, source, copier = memory
    meta, reader = channel
    gate = copier.post_gate(reader.segment, _until(1, 0), 0.1)
    guarded = copier.post_runs([(_address(source), 0, 0, 64)])
    after = copier.post_runs([(_address(source), 1, 0, 64)])
    with pytest.raises(TransferError, match="layer 0 of step 1 was not signalled"):
        gate.wait(30)
    with pytest.raises(TransferError, match="not copied: layer 0 of step 1"):
        guarded.wait(30)
    after.wait(30)  # the jobs after it run as they would have
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))  # too late
    copier.post_runs([(_address(source), 1, 64, 64)]).wait(30)
    assert not regions[0].any() and guarded.started_ns() == 0 and gate.started_ns() == 0
    assert bytes(regions[1][:128]) == bytes(source[:64]) * 2


def test_a_cancelled_gate_fails_at_once_with_its_job_unless_it_opened(memory, channel):
    from pdhal import ops

    regions, source, copier = memory
    meta, reader = channel
    gate = copier.post_gate(reader.segment, _until(1, 0), 120)
    guarded = copier.post_runs([(_address(source), 0, 0, 64)])
    second = copier.post_gate(reader.segment, _until(1, 0), 120)
    kept = copier.post_runs([(_address(source), 1, 0, 64)])
    gate.cancel()
    with pytest.raises(TransferError, match="given up before layer 0 of step 1"):
        guarded.wait(10)  # (its gate would wait 120 s)
    assert not second.done()  # the next gate still waits for its signal
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))
    kept.wait(30)
    second.cancel()  # opened already: nothing
    assert not regions[0].any() and bytes(regions[1][:64]) == bytes(source[:64])


def test_a_gate_given_up_while_it_waits_its_turn_stays_given_up_though_its_signal_came(
    memory, channel
):
    """Cancelled behind another gate, its own signal published meanwhile: when the copier
    reaches it, it fails, and its copies are never made (a request given up at its decode
    side's deadline while the copier lagged the engine)."""
    from pdhal import ops

    regions, source, copier = memory
    meta, reader = channel
    front = copier.post_gate(reader.segment, _until(1, 1), 60)
    copier.post_runs([(_address(source), 1, 0, 64)])
    late = copier.post_gate(reader.segment, _until(1, 0), 60)
    guarded = copier.post_runs([(_address(source), 0, 0, 64)])
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))  # late's signal, not front's
    late.cancel()
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1))  # the copier moves on
    with pytest.raises(TransferError, match="given up before layer 0 of step 1"):
        guarded.wait(30)
    assert front.started_ns() and not late.started_ns() and not regions[0].any()


def test_destroy_ends_a_gate_s_wait_at_once():
    """Woken, not noticed at the wait's next slice: a child whose slices last a minute
    closes a copier whose gate waits up to two."""
    run_child(
        """
        import time
        import numpy as np
        from pdhal import ops, TransferError
        from pdhal._protocol import core
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        reader = ops.open_kv_signal_reader(0, 0, timeout=30)
        region, source = np.zeros(64, np.uint8), np.ones(64, np.uint8)
        copier = core.Copier([region.ctypes.data], [64], [(source.ctypes.data, 64)])
        gate = copier.post_gate(reader.segment, (1 << core.LAYER_BITS) | 1, 120)
        job = copier.post_runs([(source.ctypes.data, 0, 0, 64)])
        time.sleep(0.2)  # the thread sleeps on the gate (were it not there yet, it ends at once)
        started = time.monotonic()
        copier.destroy()
        took = time.monotonic() - started
        assert took < 30, took  # not a slice's 60 s, nor the gate's 120
        for what, j in (("the link closed before layer 0 of step 1", gate), ("not copied", job)):
            try:
                j.wait(0)
                raise AssertionError(what)
            except TransferError as e:
                assert what in str(e), e
        assert not region.any()
        """,
        env={**os.environ, "PDHAL_WAIT_SLICE_MS": "60000"},
    )


def test_a_gate_without_a_timeout_or_a_per_query_channel_is_refused(memory, channel):
    copier, (_, reader) = memory[2], channel
    with pytest.raises(InvalidArgumentError, match="above 0"):
        copier._post(core.lib.pdhal_copier_post_gate, reader.segment.ptr, 1, 0)
    with pytest.raises(InvalidArgumentError, match="per-query channel"):
        copier._post(core.lib.pdhal_copier_post_gate, core.ffi.NULL, 1, 1)
