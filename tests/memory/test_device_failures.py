"""Every device-failure path of the cuda and xpu backends, on the simulated runtimes of
the simulated runtimes told to fail a named call (sim_fail / SIM_FAIL): the failure surfaces as a
DeviceError naming the call, nothing is published that the device did not confirm, nothing
leaks (events, host buffers, pending stores), and the next call works again."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from cffi import FFI
from simulators import DeviceTensor, SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal._protocol import signals as _signals
from pdhal.testing.fixtures import run_child, segments_of

pytestmark = pytest.mark.simulated

# What differs between the two runtimes: their library, and the names of the calls.
RUNTIMES = {
    "cuda": SimpleNamespace(
        library="libcudart_sim.so",
        env="PDHAL_CUDART",
        device="gpu:0",
        title="CUDA runtime",
        event_wait="cudaEventSynchronize",
        event_create="cudaEventCreateWithFlags",
        event_record="cudaEventRecord",
        # host_alloc: a shared segment the runtime pins (set_data_ipc shares it)
        host_alloc="cudaHostRegister",
        host_free="cudaHostUnregister",
        ipc_open="cudaIpcOpenMemHandle",
        device_count="cudaGetDeviceCount",
        # set_data_ipc asks what the memory is and where its allocation starts first
        ipc_publish_calls=[
            "cudaPointerGetAttributes",
            "cuMemGetAddressRange_v2",
            "cudaIpcGetMemHandle",
        ],
        unavailable=r"no usable GPU: cudaGetDeviceCount returned error 100 \(no CUDA-capable "
        r"device is detected\)",
    ),
    "xpu": SimpleNamespace(
        library="libxpurt.so",
        env="PDHAL_XPURT",
        device="xpu:0",
        title="XPU runtime",
        event_wait="xpu_event_wait",
        event_create="xpu_event_create",
        event_record="xpu_event_record",
        host_alloc="cudaHostRegister",  # its CUDA-compatible layer's
        host_free="cudaHostUnregister",
        ipc_open="xpu_ipc_open_memhandle",
        device_count="xpu_device_count",
        ipc_publish_calls=["xpu_ipc_get_memhandle"],
        unavailable=r"xpu_device_count failed: .*XPU runtime error 2",
    ),
}


def _select(kind: str, monkeypatch):
    """Select backend `kind` on its simulated runtime; `sim` is the runtime, `names` its
    calls. Injected failures end with the test."""
    names = RUNTIMES[kind]
    sim = SimRuntime(kind, names.library)
    sim.clear_failures()
    monkeypatch.setenv(names.env, sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", kind)
    _registry.reset()
    assert pdhal.current_backend() == kind
    yield SimpleNamespace(kind=kind, sim=sim, names=names)
    sim.clear_failures()


@pytest.fixture(params=sorted(RUNTIMES))
def dev(request, monkeypatch):
    """Each backend in turn, on its simulated runtime."""
    yield from _select(request.param, monkeypatch)


@pytest.fixture
def cuda(monkeypatch):
    yield from _select("cuda", monkeypatch)


@pytest.fixture
def xpu(monkeypatch):
    yield from _select("xpu", monkeypatch)


def failed(names, call: str) -> str:
    """The start of the DeviceError message of a failed runtime call."""
    return rf"^{call} failed: {names.title} error \d+"


def drain(sender, timeout: float = 10.0) -> None:
    """Wait until the sender thread has handled everything posted."""
    deadline = time.monotonic() + timeout
    while sender.pending:
        assert time.monotonic() < deadline, f"{sender.pending} signal(s) still pending"
        time.sleep(0.002)


def stream_reaches(sim, stream, timeout: float = 10.0) -> None:
    """Return once `stream` has run all the work queued on it before this call."""
    marker = sim.malloc(8)
    sim.launch_write(stream, marker, b"reached!", 0)
    deadline = time.monotonic() + timeout
    while ctypes.string_at(marker, 8) != b"reached!":
        assert time.monotonic() < deadline, "the stream did not reach the marker"
        time.sleep(0.002)


def mapped_channels(namespace: str) -> list[str]:
    """This process's mappings of the test's segments: a pending store holds its channel
    mapped, so once every handle is closed, a leaked store shows up here."""
    prefix = f"pdhal.{os.geteuid()}.{namespace}."
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if prefix in line]


def no_channel_left_mapped(namespace: str) -> bool:
    _signals.close_producer_channels()
    return mapped_channels(namespace) == []


# ---- layer signals ---------------------------------------------------------------------


def test_a_failed_event_wait_publishes_nothing_later_signals_flow_and_close_reports_it(
    dev, namespace
):
    sim, names = dev.sim, dev.names
    stream = sim.stream()
    events = sim.lib.sim_live_events()
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    sender = ops.create_kv_signal_sender()
    reader = ops.open_kv_signal_reader(0, 0)
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), stream, sender)
    assert reader.wait((1, -1), timeout=10) == (1, 0)

    sim.fail(names.event_wait, 1)  # the device cannot confirm layer 1
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1), stream, sender)
    drain(sender)
    assert sim.failed_calls(names.event_wait) == 1
    assert reader.current() == (1, 0), "a layer whose event wait failed was published"
    child = run_child("""
        from pdhal import ops
        with ops.open_kv_signal_reader(0, 0, timeout=10) as reader:
            print(*reader.current())
    """)
    assert child.stdout.split() == ["1", "0"], "another process sees the unconfirmed layer"

    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2), stream, sender)
    assert reader.wait((1, 0), timeout=10) == (1, 2)  # the sender keeps going
    with pytest.raises(
        pdhal.DeviceError,
        match=r"^1 layer signal\(s\) were not delivered: "
        r"waiting for their device event failed$",
    ):
        ops.destroy_kv_signal_sender(sender)
    assert sender.closed
    sender.close()  # reported once: closing again is quiet
    assert sim.lib.sim_live_events() == events  # the failed event was destroyed too
    reader.close()
    assert no_channel_left_mapped(namespace)


def test_a_failed_event_wait_on_the_default_xpu_sender_is_reported_when_it_closes(xpu, namespace):
    default_sender = _registry.selection().candidate.backend.default_sender
    sim = xpu.sim
    stream = sim.stream()
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    with ops.open_kv_signal_reader(0, 0) as reader:
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), stream)
        assert reader.wait((1, -1), timeout=10) == (1, 0)
        sim.fail("xpu_event_wait", 1)
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1), stream)
        drain(default_sender.get())
        assert reader.current() == (1, 0)
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2), stream)
        assert reader.wait((1, 0), timeout=10) == (1, 2)
    with pytest.raises(pdhal.DeviceError, match=r"^1 layer signal\(s\) were not delivered"):
        default_sender.close()
    assert no_channel_left_mapped(namespace)


@pytest.mark.parametrize("step", ["event_create", "event_record"])
def test_event_create_or_record_failure_raises_and_leaks_no_event(dev, namespace, step):
    sim, names = dev.sim, dev.names
    call = getattr(names, step)
    stream = sim.stream()
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    with ops.create_kv_signal_sender() as sender, ops.open_kv_signal_reader(0, 0) as reader:
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), stream, sender)
        assert reader.wait((1, -1), timeout=10) == (1, 0)
        drain(sender)
        events = sim.lib.sim_live_events()

        sim.fail(call, 1)
        with pytest.raises(pdhal.DeviceError, match=failed(names, call)):
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1), stream, sender)
        assert sim.failed_calls(call) == 1
        assert sim.lib.sim_live_events() == events  # a created event was destroyed
        assert sender.pending == 0  # nothing was posted
        stream_reaches(sim, stream)
        assert reader.current() == (1, 0)

        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2), stream, sender)
        assert reader.wait((1, 0), timeout=10) == (1, 2)
    # the sender closed without complaint: no event wait failed
    assert sim.lib.sim_live_events() == events
    assert no_channel_left_mapped(namespace)  # no store was left holding the channel


def test_cuda_host_function_launch_failure_raises_frees_the_store_and_publishes_nothing(
    cuda, namespace
):
    sim = cuda.sim
    stream = sim.stream()
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    with ops.open_kv_signal_reader(0, 0) as reader:
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), stream)
        assert reader.wait((1, -1), timeout=10) == (1, 0)
        sim.fail("cudaLaunchHostFunc", 1)
        with pytest.raises(
            pdhal.DeviceError,
            match=r"^cudaLaunchHostFunc failed: CUDA runtime "
            r"error 719 \(unspecified launch failure\)",
        ):
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1), stream)
        stream_reaches(sim, stream)
        assert reader.current() == (1, 0)
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2), stream)
        assert reader.wait((1, 0), timeout=10) == (1, 2)
    stream_reaches(sim, stream)
    assert no_channel_left_mapped(namespace), "the store of the failed launch leaked"


# ---- host memory -----------------------------------------------------------------------


def test_host_alloc_and_host_free_failures_raise_and_leak_nothing(dev):
    sim, names = dev.sim, dev.names
    live = sim.lib.sim_live_host_buffers()
    sim.fail(names.host_alloc, 1)
    with pytest.raises(
        pdhal.DeviceError,
        match=rf"^{names.host_alloc}\(65536 bytes of host_alloc\) failed: {names.title} error \d+",
    ):
        ops.host_alloc(65536)
    assert sim.lib.sim_live_host_buffers() == live

    buf = ops.host_alloc(65536)  # the runtime works again
    sim.fail(names.host_free, 1)
    with pytest.raises(pdhal.DeviceError, match=failed(names, names.host_free)):
        ops.host_free(buf)
    # still owned, so freeing again returns it to the runtime
    assert not buf.closed and sim.lib.sim_live_host_buffers() == live + 1
    ops.host_free(buf)
    assert buf.closed and sim.lib.sim_live_host_buffers() == live


# ---- peer addresses and IPC ------------------------------------------------------------


def test_pointer_attributes_failure_in_get_peer_mem_addr_raises(dev):
    sim, names = dev.sim, dev.names
    tensor = DeviceTensor(sim.malloc(4096) + 64, 64, names.device)
    sim.fail("cudaPointerGetAttributes", 1)
    with pytest.raises(pdhal.DeviceError, match=failed(names, "cudaPointerGetAttributes")):
        ops.get_peer_mem_addr(tensor)
    assert ops.get_peer_mem_addr(tensor)  # and works again


def test_ipc_handle_failure_in_set_data_ipc_publishes_nothing(dev, namespace):
    sim, names = dev.sim, dev.names
    block = sim.malloc(1 << 16)
    ctypes.memmove(block + 4096, b"kv-cache-bytes", 14)
    tensor = DeviceTensor(block + 4096, 256, names.device)
    for call in names.ipc_publish_calls:
        sim.fail(call, 1)
        with pytest.raises(pdhal.DeviceError, match=failed(names, call)):
            ops.set_data_ipc(tensor, "kv")
        assert sim.failed_calls(call) == 1
        assert segments_of(namespace) == []  # no record under any name
        with pytest.raises(pdhal.SegmentError, match="does not exist"):
            ops.share_external_data(np.zeros(1, np.uint8), "kv", [256], timeout=0.1)
    ops.set_data_ipc(tensor, "kv")  # no half state left in the way
    run_child("""
        import ctypes, numpy as np
        from pdhal import ops
        kv = ops.share_external_data(np.zeros(1, np.uint8), "kv", [256], timeout=10)
        assert ctypes.string_at(kv.address, 14) == b"kv-cache-bytes"
    """)


def test_ipc_open_failure_in_share_external_data_raises_and_the_next_open_works(dev):
    sim, names = dev.sim, dev.names
    tensor = sim.malloc(4096)
    ctypes.memmove(tensor, b"kv-cache-bytes", 14)
    ops.set_data_ipc(DeviceTensor(tensor, 256, names.device), "kv")
    # The reader is another process, told through SIM_FAIL before its runtime loads.
    run_child(
        f"""
        import ctypes, numpy as np, pdhal
        from pdhal import ops
        try:
            ops.share_external_data(np.zeros(1, np.uint8), "kv", [256], timeout=10)
        except pdhal.DeviceError as e:
            assert str(e).startswith("{names.ipc_open} failed: {names.title} error"), e
        else:
            raise AssertionError("the injected {names.ipc_open} failure did not surface")
        kv = ops.share_external_data(np.zeros(1, np.uint8), "kv", [256], timeout=10)
        assert ctypes.string_at(kv.address, 14) == b"kv-cache-bytes"
    """,
        env=dict(os.environ, SIM_FAIL=f"{names.ipc_open}:1"),
    )


# ---- device count ----------------------------------------------------------------------


def test_device_count_failure_makes_the_backend_unavailable_with_the_reason(dev, monkeypatch):
    sim, names = dev.sim, dev.names
    monkeypatch.delenv("PDHAL_PLATFORM")
    sim.fail(names.device_count)  # every call
    _registry.reset()
    assert pdhal.current_backend() != dev.kind
    cand = {c.name: c for c in _registry.selection().candidates}[dev.kind]
    assert not cand.availability.available
    assert re.search(names.unavailable, cand.availability.reason), cand.availability.reason
    monkeypatch.setenv("PDHAL_PLATFORM", dev.kind)
    _registry.reset()
    with pytest.raises(pdhal.BackendUnavailableError, match=names.unavailable):
        pdhal.current_platform()

    # `pdhal info` in a process told through SIM_FAIL reports it, and does not crash.
    env = dict(os.environ, SIM_FAIL=names.device_count)
    env.pop("PDHAL_PLATFORM")
    info = subprocess.run(
        [sys.executable, "-m", "pdhal", "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert info.returncode == 0, info.stderr
    line = next(ln for ln in info.stdout.splitlines() if ln.split()[:1] == [dev.kind])
    assert line.split()[1] == "unavailable"
    assert re.search(names.unavailable, line), line


def test_device_count_failure_after_selection_raises_device_error(dev):
    platform = pdhal.current_platform()
    count = platform.device_count()
    dev.sim.fail(dev.names.device_count, 1)
    # a failed count is an error, not "no devices"
    with pytest.raises(pdhal.DeviceError, match=failed(dev.names, dev.names.device_count)):
        platform.device_count()
    assert platform.device_count() == count >= 1


# ---- the injection itself --------------------------------------------------------------

# A call each simulator exports that no backend makes: (name, declaration, a call of it).
SIM_CALLS = {
    "cuda": (
        "cudaMalloc",
        "int cudaMalloc(void **ptr, size_t size);",
        'lib.cudaMalloc(ffi.new("void **"), 64)',
    ),
    "xpu": (
        "xpu_memcpy",
        "int xpu_memcpy(void *dst, const void *src, uint64_t size, int kind);",
        'lib.xpu_memcpy(ffi.new("char[4]"), b"abc", 4, 0)',
    ),
}


def test_the_simulators_let_an_event_be_destroyed_while_its_record_is_queued(dev):
    """As CUDA allows (and pdhal does, refusing a post after recording): the queued record
    and a stream's wait on it still run, then the event is freed (under make sanitize the
    simulators are built with ASan, which reported a use after free here)."""
    ffi = FFI()
    ffi.cdef("""void *sim_event_new(void); void sim_event_free(void *e);
                void sim_event_record(void *e, void *s); void sim_stream_sync(void *s);
                void sim_stream_wait_event(void *s, void *e); int sim_live_events(void);
                void sim_stream_host_fn(void *s, void (*fn)(void *), void *arg);
                int sem_init(void *sem, int shared, unsigned value); int sem_wait(void *sem);
                int sem_post(void *sem);""")
    lib, libc = ffi.dlopen(dev.sim.path), ffi.dlopen(None)
    held, waiting = (ffi.cast("void *", dev.sim.stream()) for _ in range(2))
    gate = ffi.new("char[64]")  # a sem_t: the held stream blocks on it
    assert libc.sem_init(gate, 0, 0) == 0
    lib.sim_stream_host_fn(held, ffi.cast("void (*)(void *)", libc.sem_wait), gate)
    live = lib.sim_live_events()
    event = lib.sim_event_new()
    lib.sim_event_record(event, held)  # queued behind the gate
    lib.sim_stream_wait_event(waiting, event)
    lib.sim_event_free(event)
    assert lib.sim_live_events() == live  # released by its owner at once
    libc.sem_post(gate)
    lib.sim_stream_sync(waiting)  # the wait ran after the record fired: no hang, no crash
    lib.sim_stream_sync(held)


def test_the_simulators_fail_the_calls_they_are_told_to(dev):
    name, cdef, source = SIM_CALLS[dev.kind]
    ffi = FFI()
    ffi.cdef(cdef)
    lib = ffi.dlopen(dev.sim.path)  # the same copy of the runtime as the backend's

    def fails() -> bool:
        return eval(source, {"lib": lib, "ffi": ffi}) != 0

    dev.sim.fail(name, 2)
    assert [fails() for _ in range(3)] == [True, True, False]
    dev.sim.fail(name)  # every call
    assert all(fails() for _ in range(5))
    dev.sim.fail(name, 0)  # stop
    assert not fails()
    assert dev.sim.failed_calls(name) == 7
    dev.sim.clear_failures()
    assert dev.sim.failed_calls(name) == 0
    # SIM_FAIL="name[:count],...", read when the library loads; no count means every call.
    count = dev.names.device_count
    child = run_child(
        f"""
        from cffi import FFI
        ffi = FFI()
        ffi.cdef({cdef!r} + "int {count}(int *count); int sim_failed_calls(const char *f);")
        lib = ffi.dlopen({dev.sim.path!r})
        print(*[int({source} != 0) for _ in range(3)], lib.sim_failed_calls(b"{name}"))
        print(*[int(lib.{count}(ffi.new("int *")) != 0) for _ in range(3)])
    """,
        env=dict(os.environ, SIM_FAIL=f"no_such_call:1,{name}:2,{count}"),
    )
    assert child.stdout.splitlines() == ["1 1 0 2", "1 1 1"]
