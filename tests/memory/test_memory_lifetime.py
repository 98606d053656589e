"""Memory one thread frees while another thread's op uses it (docs/api.md, thread safety):
the op finishes on the memory, or is refused, and the free waits for it; copies queued on a
device stream count as in use until they ran. Races run in a child process, so a use after
free is the child's crash (or, under make sanitize, an ASan report), not this test's.
cuda and xpu run on the SIMULATED runtimes of pdhal-cuda and pdhal-xpu."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
from simulators import DeviceTensor, SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.testing.fixtures import run_child

SIMULATED = {"cuda": ("PDHAL_CUDART", "libcudart_sim.so"), "xpu": ("PDHAL_XPURT", "libxpurt.so")}
BACKENDS = ["cpu", *(pytest.param(b, marks=pytest.mark.simulated) for b in SIMULATED)]


def _select(backend: str, monkeypatch) -> SimRuntime | None:
    sim = None
    if backend in SIMULATED:
        variable, library = SIMULATED[backend]
        sim = SimRuntime(backend, library)
        monkeypatch.setenv(variable, sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", backend)
    _registry.reset()
    return sim


# The child: each round allocates a source (host) and a destination (device), starts a
# thread that copies between them until it is refused, frees the source after the thread's
# first copy, and checks what the thread saw. FORM names the form the memory takes.
RACE = """
import threading, pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.compat import fastdeploy as fd

device = _registry.selection().candidate.backend.test_support()  # dst: device memory

FORMS = {
    "host_free": (ops.host_alloc, ops.host_free, lambda b: b),
    "close": (ops.host_alloc, lambda b: b.close(), lambda b: b),
    "int": (fd.cuda_host_alloc, fd.cuda_host_free, lambda b: b),
}
alloc, free, handle = FORMS[FORM]
BLOCK, BLOCKS = 1 << 16, 64
refused = copied = 0
for _ in range(ROUNDS):
    src, dst = alloc(BLOCK * BLOCKS), device.alloc(BLOCK * BLOCKS)
    started, outcome = threading.Event(), []

    def copy():
        n = 0
        try:
            while True:
                ops.copy_blocks(dst, list(range(BLOCKS)), handle(src), list(range(BLOCKS)), BLOCK)
                ops.synchronize()
                n += 1
                started.set()
        except (pdhal.ClosedHandleError, pdhal.InvalidArgumentError) as e:
            outcome.append((n, e))
        except BaseException as e:
            outcome.append((n, e))
            raise
        finally:
            started.set()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    started.wait(60)
    free(src)
    thread.join(60)
    assert not thread.is_alive(), "the copier hung"
    n, error = outcome[0]
    assert isinstance(error, (pdhal.ClosedHandleError, pdhal.InvalidArgumentError)), error
    assert "freed" in str(error) or "did not hand out" in str(error), error
    copied += n
    refused += 1
device.release()
assert copied >= ROUNDS and refused == ROUNDS, (copied, refused)
print("rounds", ROUNDS, "copies", copied)
"""


@pytest.mark.parametrize("form", ["host_free", "close", "int"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_free_racing_copies_lets_each_copy_finish_and_refuses_the_next(
    backend, form, monkeypatch
):
    _select(backend, monkeypatch)
    proc = run_child(f"FORM, ROUNDS = {form!r}, 150\n" + RACE, timeout=300)
    assert "rounds 150" in proc.stdout


def _slow_stream(sim: SimRuntime, scratch: DeviceTensor) -> int:
    """A stream busy for 300 ms (a kernel that sleeps, then writes scratch), so a copy
    queued behind it runs only well after the call that queued it returned."""
    stream = sim.stream()
    sim.launch_write(stream, scratch.address, b"x", 300_000)
    return stream


@pytest.mark.simulated
@pytest.mark.parametrize("backend", list(SIMULATED))
def test_a_free_waits_for_the_copies_queued_on_it(backend, monkeypatch):
    """host_free of a pinned source returns only once the queued copy out of it has run:
    the destination holds the bytes when the free returns, although the stream was still
    busy when the copy was queued; so does a free after a copy into the buffer through an
    array over it (the copy holds the buffer as through the buffer)."""
    sim = _select(backend, monkeypatch)
    into = ops.host_alloc(4096)
    source = sim.device.alloc(4096)
    ctypes.memset(source.address, 3, 4096)
    view, scratch = into.as_numpy(np.uint8, [4096]), sim.device.alloc(64)
    ops.copy_blocks(view, [0], source, [0], 4096, stream=_slow_stream(sim, scratch))
    ops.host_free(into)  # waits for the copy: unregistered and unmapped only after it ran
    assert ctypes.string_at(scratch.address, 1) == b"x", "the free did not wait for the copy"
    del view
    # the same through the array share_external_data returns over shared host memory: its
    # unmapping waits for the copy queued into it
    owner = ops.host_alloc(4096)
    ops.set_data_ipc(owner.as_numpy(np.uint8, [4096]), "kv_host_lifetime")
    mapped = ops.share_external_data("uint8", "kv_host_lifetime", [4096])
    scratch = sim.device.alloc(64)
    ops.copy_blocks(mapped, [0], source, [0], 4096, stream=_slow_stream(sim, scratch))
    ops.unset_data_ipc(None, "kv_host_lifetime", True, True)
    assert ctypes.string_at(scratch.address, 1) == b"x", "the unmap did not wait for the copy"
    assert owner.as_numpy(np.uint8, [4096])[0] == 3
    del mapped
    ops.host_free(owner)
    for form in ("buffer", "int"):
        src = ops.host_alloc(4096)
        src.as_numpy(np.uint8, [4096])[:] = 7
        dst = sim.device.alloc(4096)
        stream = _slow_stream(sim, sim.device.alloc(64))
        if form == "int":
            from pdhal.compat import fastdeploy as fd

            address = fd.cuda_host_alloc(4096)
            ctypes.memset(address, 7, 4096)
            ops.copy_blocks(dst, [0], address, [0], 4096, stream=stream)
            fd.cuda_host_free(address)
            ops.host_free(src)
        else:
            ops.copy_blocks(dst, [0], src, [0], 4096, stream=stream)
            ops.host_free(src)
        assert ctypes.string_at(dst.address, 4096) == b"\x07" * 4096, form
        with pytest.raises(pdhal.ClosedHandleError):
            ops.copy_blocks(dst, [0], src, [0], 4096, stream=stream)


@pytest.mark.simulated
@pytest.mark.parametrize("backend", list(SIMULATED))
def test_unregistering_host_memory_waits_for_the_copies_queued_on_it(backend, monkeypatch):
    sim = _select(backend, monkeypatch)
    host = np.full(4096, 9, np.uint8)
    address = host.ctypes.data
    ops.host_register(host)
    dst = sim.device.alloc(4096)
    ops.copy_blocks(dst, [0], address, [0], 4096, stream=_slow_stream(sim, sim.device.alloc(64)))
    ops.host_unregister(host)
    assert ctypes.string_at(dst.address, 4096) == b"\x09" * 4096
    with pytest.raises(pdhal.InvalidArgumentError, match="did not hand out"):
        ops.copy_blocks(dst, [0], address, [0], 4096)


@pytest.mark.simulated
@pytest.mark.parametrize("backend", list(SIMULATED))
def test_unmapping_a_shared_buffer_waits_for_queued_copies_and_refuses_later_ones(
    backend, monkeypatch
):
    """unset_data_ipc(close_ipc=True) of an imported cache: a copy queued into it lands
    before the mapping closes; the buffer object and an address inside it are refused
    afterwards (the mapping is gone), never written through."""
    sim = _select(backend, monkeypatch)
    owner = DeviceTensor(sim.malloc(8192), 8192, f"{'gpu' if backend == 'cuda' else 'xpu'}:0")
    ops.set_data_ipc(owner, "kv_lifetime")
    shared = ops.share_external_data(np.zeros(1, np.uint8), "kv_lifetime", [8192])
    address = ops.get_data_ptr_ipc(None, "kv_lifetime")
    src = ops.host_alloc(4096)
    src.as_numpy(np.uint8, [4096])[:] = 5
    ops.copy_blocks(shared, [1], src, [0], 4096, stream=_slow_stream(sim, sim.device.alloc(64)))
    ops.unset_data_ipc(shared, "kv_lifetime", True, True)
    assert ctypes.string_at(owner.address + 4096, 4096) == b"\x05" * 4096
    with pytest.raises(pdhal.ClosedHandleError, match="unmapped"):
        ops.copy_blocks(shared, [0], src, [0], 4096)
    with pytest.raises(pdhal.InvalidArgumentError, match="did not hand out"):
        ops.copy_blocks(address, [0], src, [0], 4096)
    ops.host_free(src)


@pytest.mark.simulated
def test_unmapping_a_shared_buffer_while_threads_copy_into_it(monkeypatch):
    """Threads copy into an imported cache while another unmaps it: each copy either ran
    before the unmap or was refused; the free of the mapping waited for the ones in flight."""
    sim = _select("cuda", monkeypatch)
    for round_ in range(20):
        name = f"kv_race{round_}"
        owner = DeviceTensor(sim.malloc(1 << 20), 1 << 20, "gpu:0")
        ops.set_data_ipc(owner, name)
        shared = ops.share_external_data(np.zeros(1, np.uint8), name, [1 << 20])
        src = ops.host_alloc(1 << 20)
        refused: list[BaseException] = []
        started = threading.Barrier(5)

        def copy(shared=shared, src=src, refused=refused, started=started):
            started.wait()
            try:
                while True:
                    ops.copy_blocks(shared, list(range(16)), src, list(range(16)), 1 << 16)
            except pdhal.ClosedHandleError as e:
                refused.append(e)

        threads = [threading.Thread(target=copy, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait()
        ops.unset_data_ipc(shared, name, True, True)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a copier hung"
        assert len(refused) == 4, refused
        ops.synchronize()
        ops.host_free(src)


def test_a_retiring_extent_refuses_new_holds_and_waits_for_the_old_ones():
    """The contract itself, step by step: an op holds; a free (retire) waits for it and
    refuses every hold that comes meanwhile; the free returns once the op let go, with the
    streams the op queued work on."""
    from pdhal._memory import extents as _extents

    extent = _extents.register(0x10000, 4096, "cpu", "test memory")
    held = _extents.hold([extent, None])
    streams: list[set[int]] = []
    _extents.mark_queued(held, "stream 7")
    free = threading.Thread(target=lambda: streams.append(_extents.retire(extent)), daemon=True)
    free.start()
    deadline = time.monotonic() + 60
    while not extent.retired and time.monotonic() < deadline:  # the free has begun
        time.sleep(0.001)
    assert extent.retired and free.is_alive(), "retire returned while an op held the memory"
    assert _extents.find(0x10000) is None  # no new op finds it by address either
    with pytest.raises(pdhal.ClosedHandleError, match="test memory"):
        _extents.hold([extent])
    _extents.release(held)
    free.join(60)
    assert not free.is_alive() and streams == [{"stream 7"}]
    assert _extents.retire(extent) == {"stream 7"}  # idempotent


def test_a_free_kept_waiting_by_an_op_that_never_lets_go_says_which_memory(monkeypatch, caplog):
    """A holder leaked (an op interrupted inside its hold, say) would make a free wait
    forever: it waits on, and logs the memory and how many ops hold it, every slice."""
    from pdhal._memory import extents as _extents

    monkeypatch.setattr(_extents, "STILL_WAITING_S", 0.05)
    extent = _extents.register(0x20000, 64, "cpu", "leaked memory")
    held = _extents.hold([extent])
    free = threading.Thread(target=_extents.retire, args=(extent,), daemon=True)
    with caplog.at_level("WARNING", logger="pdhal"):
        free.start()
        deadline = time.monotonic() + 60
        while "leaked memory" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "leaked memory" in caplog.text and "(1 ops)" in caplog.text
        assert free.is_alive()
    _extents.release(held)
    free.join(60)
    assert not free.is_alive()
