"""The xpu backend against the SIMULATED Kunlunxin runtime of pdhal_xpu.testing (no XPU
hardware exists here). Streams are worker threads; a test-only kernel writes memory after a
delay, so a signal stored too early is caught."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from pdhal_xpu.testing import XpuTestSupport

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.testing import DeviceTensor
from pdhal.testing.fixtures import python_child, run_child, thread_count, thread_count_settled
from pdhal.testing.simulated import SimulatedRuntime

pytestmark = pytest.mark.simulated


@pytest.fixture
def sim(monkeypatch):
    sim = SimulatedRuntime(XpuTestSupport)
    monkeypatch.setenv("PDHAL_XPURT", sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
    _registry.reset()
    assert pdhal.current_backend() == "xpu"
    return sim


def test_info_names_the_library_and_version(sim):
    info = subprocess.run(
        [sys.executable, "-m", "pdhal", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert "selected: xpu" in info
    assert f"library: {os.environ['PDHAL_XPURT']}" in info and "runtime_version: 4.31" in info


def test_10000_layers_through_one_sender_arrive_complete_and_in_order(sim):
    steps, layers = 100, 100
    reader = python_child(f"""
        import array
        from pdhal import ops
        out = array.array("i", [0] * 1538)
        for step in range(1, {steps} + 1):
            for layer in range({layers}):
                ops.get_output_kv_signal(out, 0, True, timeout=30)
                assert (out[0], out[1], out[4]) == (1, layer, step), (step, layer, list(out[:5]))
    """)
    stream = sim.stream()
    with ops.create_kv_signal_sender() as sender:
        for step in range(1, steps + 1):
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, layers)
            for layer in range(layers):
                ops.signal_layer_ready(chunk.layer(layer), stream, sender)
    assert reader.wait(timeout=60) == 0


def test_destroy_delivers_1000_queued_signals(sim):
    stream = sim.stream()
    dev = sim.malloc(64)
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    events = sim.lib.sim_live_events()  # other tests' copy fences (buffers never freed) stay
    sender = ops.create_kv_signal_sender()
    sim.launch_write(stream, dev, b"x" * 64, 300000)  # holds every event behind it
    for layer in range(1000):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream, sender)
    assert sender.pending >= 990
    ops.destroy_kv_signal_sender(sender)
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (1, 999)
    assert sim.lib.sim_live_events() == events


def test_a_sender_per_step_leaves_no_thread_or_event(sim):
    stream = sim.stream()
    threads, events = thread_count(), sim.lib.sim_live_events()
    for _ in range(1000):
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        with ops.create_kv_signal_sender() as sender:
            for layer in range(3):
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer), stream, sender)
    assert (thread_count_settled(threads), sim.lib.sim_live_events()) == (threads, events)
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (1000, 2)


def test_default_sender_is_used_when_none_is_given(sim):
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), sim.stream())
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.wait((1, -1), timeout=5) == (1, 0)


def test_idle_sender_thread_uses_no_cpu(sim):
    with ops.create_kv_signal_sender():
        tid = max(int(t) for t in os.listdir("/proc/self/task"))

        def ticks():
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])

        start = ticks()
        time.sleep(1.0)
        assert ticks() - start <= 1


def test_a_cpu_sender_is_refused(sim):
    from pdhal._protocol.sender import KVSignalSender

    meta = ops.open_shm_and_get_meta_signal(0, 0)
    with KVSignalSender() as foreign, pytest.raises(pdhal.InvalidArgumentError, match="xpu"):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), 0, foreign)


def test_peer_address_is_the_runtime_alias_of_the_same_bytes(sim):
    dev = sim.malloc(4096)
    ctypes.memmove(dev + 100, b"peer", 4)
    alias = ops.get_peer_mem_addr(DeviceTensor(dev + 100, 16, "xpu:0"))
    assert alias != dev + 100
    assert ctypes.string_at(alias, 4) == b"peer"
    assert ops.get_peer_mem_addr(dev) == alias - 100


def test_peer_address_of_unknown_memory_raises(sim):
    host = np.zeros(64, np.uint8)
    with pytest.raises(pdhal.InvalidArgumentError, match=f"{host.ctypes.data:#x} has no peer"):
        ops.get_peer_mem_addr(host)


def test_old_runtime_reports_unsupported(monkeypatch):
    monkeypatch.setenv("PDHAL_XPURT", XpuTestSupport.simulator("libxpurt_old.so"))
    monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
    _registry.reset()
    with pytest.raises(pdhal.UnsupportedError, match="unsupported by this XPU runtime version"):
        ops.get_peer_mem_addr(np.zeros(4, np.uint8))
    with pytest.raises(pdhal.UnsupportedError, match="has no cudaHostRegister"):
        ops.set_data_ipc(np.zeros(4, np.uint8), "kv")
    caps = pdhal.current_platform().capabilities
    assert caps["ipc"] is False and caps["peer_address"] is False


def test_host_memory_comes_from_and_returns_to_the_runtime(sim):
    live = sim.lib.sim_live_host_buffers()
    buf = ops.host_alloc(1 << 16)
    assert buf.pinned and sim.lib.sim_live_host_buffers() == live + 1
    buf.as_numpy("uint8", (1 << 16,))[:] = 3
    ops.host_free(buf)
    assert sim.lib.sim_live_host_buffers() == live
    with pytest.raises(pdhal.InvalidTypeError, match="xpu backend's host_alloc"):
        ops.host_free(bytearray(4))


def test_cache_process_on_device_5_of_4567(sim, monkeypatch):
    monkeypatch.setenv("XPU_VISIBLE_DEVICES", "4,5,6,7")
    env = pdhal.current_platform().child_env([5])
    assert env["XPU_VISIBLE_DEVICES"] == "5"
    proc = run_child(
        """
        import pdhal
        p = pdhal.current_platform()
        print(p.name, p.physical_device_id(0))
    """,
        env=env,
    )
    assert proc.stdout.split() == ["xpu", "5"]


def test_missing_runtime_is_unavailable_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("PDHAL_XPURT", str(tmp_path / "libxpurt.so"))
    _registry.reset()
    assert pdhal.current_backend() == "cpu"
    xpu = {c.name: c for c in _registry.selection().candidates}["xpu"]
    assert not xpu.availability.available and "not loadable" in xpu.availability.reason
    monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
    _registry.reset()
    with pytest.raises(pdhal.BackendUnavailableError, match="pdhal-xpu.*not loadable"):
        pdhal.current_platform()


def test_zero_devices_is_unavailable(monkeypatch):
    monkeypatch.setenv("PDHAL_XPURT", XpuTestSupport.simulator("libxpurt.so"))
    monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
    monkeypatch.setenv("SIM_XPU_DEVICES", "0")
    _registry.reset()
    with pytest.raises(pdhal.BackendUnavailableError, match="no XPU device"):
        pdhal.current_platform()


def test_runtime_is_found_in_a_paddle_xpu_wheel_without_importing_paddle(tmp_path):
    fake = tmp_path / "paddle"
    (fake / "libs").mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('paddle must not be imported')\n")
    os.symlink(XpuTestSupport.simulator("libxpurt.so"), fake / "libs" / "libxpurt.so")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PDHAL_PLATFORM="xpu")
    env.pop("PDHAL_XPURT", None)
    proc = run_child(
        """
        import sys, pdhal
        from pdhal._backends import registry as _registry
        info = _registry.selection().candidate.backend.info()
        assert "paddle" not in sys.modules
        print(info["found_by"], info["library"])
    """,
        env=env,
    )
    assert proc.stdout.split() == ["paddle", "wheel", str(fake / "libs" / "libxpurt.so")]


def test_a_shared_cache_is_mapped_once_and_unset_keeps_it_when_refused(sim):
    """One IPC mapping per handle (every call used to open another, never closed); an
    unset the runtime refuses (another process's record) leaves the mapping as it was."""
    kv = DeviceTensor(sim.malloc(4096), 4096, "xpu:0")
    ops.set_data_ipc(kv, "kv_once")
    first = ops.share_external_data(np.zeros(1, np.uint8), "kv_once", [4096])
    again = ops.share_external_data(np.zeros(1, np.uint8), "kv_once", [1024])
    assert first.address == again.address == ops.get_data_ptr_ipc(None, "kv_once")
    assert first.device == "xpu:0"
