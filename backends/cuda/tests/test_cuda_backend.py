"""The cuda backend against the SIMULATED CUDA runtime of pdhal_cuda.testing (no GPU here),
and against the real libcudart on this machine (which has no driver, so: no device)."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from pdhal_cuda.testing import CudaTestSupport

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.testing import DeviceTensor
from pdhal.testing.fixtures import python_child, run_child
from pdhal.testing.simulated import SimulatedRuntime

pytestmark = pytest.mark.simulated


@pytest.fixture
def sim(monkeypatch):
    sim = SimulatedRuntime(CudaTestSupport)
    monkeypatch.setenv("PDHAL_CUDART", sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", "cuda")
    _registry.reset()
    assert pdhal.current_backend() == "cuda"
    return sim


def test_10000_layers_across_4_streams_arrive_complete_and_in_stream_order(sim):
    streams, steps, layers = 4, 25, 100
    reader = python_child(f"""
        import array, threading
        from pdhal import ops
        failures = []
        def read(rank):
            try:
                with ops.open_kv_chunk_reader(rank, 0, timeout=30) as chunks:
                    out = array.array("i", [0] * 1538)
                    for step in range(1, {steps} + 1):
                        for layer in range({layers}):
                            assert chunks.next(out, timeout=30) == step
                            assert (out[0], out[1], out[4]) == (1, layer, rank * 1000 + step)
            except BaseException as e:
                failures.append((rank, e))
        threads = [threading.Thread(target=read, args=(r,)) for r in range({streams})]
        for t in threads: t.start()
        for t in threads: t.join()
        assert not failures, failures
    """)
    handles = [sim.stream() for _ in range(streams)]
    for step in range(1, steps + 1):
        for rank, stream in enumerate(handles):
            n = rank * 1000 + step
            chunk = ops.init_kv_signal_per_query([n], [n], [0], rank, layers)
            for layer in range(layers):
                ops.signal_layer_ready(chunk.layer(layer), stream)
    assert reader.wait(timeout=120) == 0


def test_freeing_per_step_buffers_right_after_posting_changes_nothing(sim):
    steps, layers = 30, 6
    reader = python_child(f"""
        import array
        from pdhal import ops
        out = array.array("i", [0] * 1538)
        for step in range(1, {steps} + 1):
            for layer in range({layers}):
                ops.get_output_kv_signal(out, 0, True, timeout=30)
                want = [2, layer, 0, step, 64 + step, 2, 0, step]
                assert list(out[:8]) == want, (step, layer, list(out[:8]))
    """)
    stream, scratch = sim.stream(), sim.malloc(64)
    for step in range(1, steps + 1):
        encoder = np.array([64 + step, 0, step], dtype=np.int32)  # the engine's step buffers
        decoder = np.array([step, 9, 0], dtype=np.int32)
        chunk = ops.init_kv_signal_per_query(encoder, encoder, decoder, 0, layers)
        for layer in range(layers):
            sim.launch_write(stream, scratch, b"k" * 64, 2000)
            ops.signal_layer_ready(chunk.layer(layer), stream)
        del encoder, decoder, chunk
        gc.collect()
        [np.full(64, -1, dtype=np.int32) for _ in range(100)]  # reuse the freed memory
    assert reader.wait(timeout=60) == 0


def test_ipc_of_a_tensor_inside_a_larger_allocation(sim):
    block = sim.malloc(1 << 20)
    tensor = block + 4096 + 64  # like a tensor carved out of an allocator's block
    ctypes.memmove(tensor, b"kv-cache-bytes", 14)
    ops.set_data_ipc(DeviceTensor(tensor, 256, "gpu:0"), "kv")
    run_child("""
        import ctypes, numpy as np
        from pdhal import ops
        kv = ops.share_external_data(np.zeros(1, np.uint8), "kv", [256])
        assert ctypes.string_at(kv.address, 14) == b"kv-cache-bytes"
        ctypes.memmove(kv.address + 14, b"!", 1)
    """)
    assert ctypes.string_at(tensor, 15) == b"kv-cache-bytes!"


def test_peer_address_is_the_device_address_of_known_memory_only(sim):
    dev = sim.malloc(4096)
    assert ops.get_peer_mem_addr(DeviceTensor(dev + 8, 8, "gpu:0")) == dev + 8
    pinned = ops.host_alloc(4096)
    assert ops.get_peer_mem_addr(pinned.address) == pinned.address
    ops.host_free(pinned)
    host = np.zeros(64, np.uint8)
    with pytest.raises(pdhal.InvalidArgumentError, match="is unregistered for CUDA"):
        ops.get_peer_mem_addr(host)
    with pytest.raises(pdhal.UnsupportedError, match="shares host memory allocated by pdhal"):
        ops.set_data_ipc(host, "kv")  # host memory it shares is host_alloc's (a segment)


def test_host_memory_comes_from_and_returns_to_the_runtime(sim):
    live = sim.lib.sim_live_host_buffers()
    buf = ops.cuda_host_alloc(1 << 16)
    assert buf.pinned and sim.lib.sim_live_host_buffers() == live + 1
    ops.cuda_host_free(buf)
    assert sim.lib.sim_live_host_buffers() == live


def test_streams_are_ints_or_objects_with_cuda_stream(sim):
    meta = ops.open_shm_and_get_meta_signal(0, 0)

    class TorchLikeStream:
        cuda_stream = sim.stream()

    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), TorchLikeStream())
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 1))  # default stream
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.wait((1, 0), timeout=5) == (1, 1)
    with pytest.raises(pdhal.InvalidTypeError, match="cuda_stream"):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2), "stream")


def test_cache_process_on_a_mig_instance(sim, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa,MIG-bbbb")
    env = pdhal.current_platform().child_env(["MIG-bbbb"])
    proc = run_child(
        """
        import pdhal
        print(pdhal.current_platform().physical_device_id(0))
    """,
        env=env,
    )
    assert proc.stdout.strip() == "MIG-bbbb"


@pytest.mark.parametrize(
    "driver, words",
    [
        ("none", r"no NVIDIA driver here \(libcuda.so.1 is not installed\)"),
        (
            "old",
            r"the NVIDIA driver supports CUDA 11.8, older than this runtime's 12.8 .*update the "
            r"driver, or set PDHAL_CUDART",
        ),
    ],
)
def test_no_driver_and_an_old_driver_are_told_apart(tmp_path, driver, words):
    """CUDA reports both as error 35 ("driver version is insufficient"), which misled users
    of machines with no driver at all."""
    env = dict(os.environ, PDHAL_CUDART=SimulatedRuntime(CudaTestSupport).path)
    if driver == "none":
        env["SIM_CUDA_NO_DRIVER"] = "1"
        env["LD_LIBRARY_PATH"] = str(tmp_path)  # holds no libcuda.so.1
    else:
        env["SIM_CUDA_OLD_DRIVER"] = "1"
        stub = tmp_path / "libcuda.so.1"  # a driver library is there, only too old
        source = tmp_path / "stub.c"
        source.write_text("int cuStub(void) { return 0; }\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stub), str(source)], check=True)
        env["LD_LIBRARY_PATH"] = str(tmp_path)
    auto = run_child("import pdhal; print(pdhal.current_backend())", env=env)
    assert auto.stdout.strip() == "cpu"
    forced = subprocess.run(
        [sys.executable, "-c", "import pdhal; pdhal.current_platform()"],
        env=dict(env, PDHAL_PLATFORM="cuda"),
        capture_output=True,
        text=True,
    )
    assert forced.returncode != 0 and "BackendUnavailableError" in forced.stderr
    assert re.search(words, forced.stderr), forced.stderr[-500:]


def _real_cudart() -> str | None:
    for soname in ("libcudart.so.13", "libcudart.so.12"):
        try:
            ctypes.CDLL(soname)
            return soname
        except OSError:
            pass
    return None


@pytest.mark.skipif(
    _real_cudart() is None,
    reason="needs the CUDA runtime library installed (this project's machines have it)",
)
def test_real_libcudart_loads_and_reports_no_device_cleanly(monkeypatch):
    monkeypatch.delenv("PDHAL_CUDART", raising=False)
    env = dict(os.environ, PDHAL_PLATFORM="cuda")
    forced = subprocess.run(
        [sys.executable, "-c", "import pdhal; pdhal.current_platform()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert forced.returncode != 0
    assert "BackendUnavailableError" in forced.stderr
    assert "NVIDIA driver" in forced.stderr
    auto = run_child("""
        from pdhal._tools import info as _info
        info = _info.report()
        cuda = {b["name"]: b for b in info["backends"]}["cuda"]
        print(info["selected"], cuda["status"], cuda["runtime"]["library"])
    """)
    assert auto.stdout.split() == ["cpu", "unavailable", _real_cudart()]


def test_a_mapping_names_the_device_this_thread_uses(sim):
    """A cache process on device 1 maps a peer's cache onto device 1 (a DLPack consumer
    puts the tensor there), not onto device 0."""
    kv = DeviceTensor(sim.malloc(4096), 4096, "gpu:0")
    ops.set_data_ipc(kv, "kv_dev")
    backend = _registry.selection().candidate.backend
    rt = backend.runtime
    assert rt.lib.cudaSetDevice(1) == 0
    try:
        shared = ops.share_external_data(np.zeros(1, np.uint8), "kv_dev", [4096])
        assert shared.device == "gpu:1" and shared.__dlpack_device__() == (2, 1)
    finally:
        rt.lib.cudaSetDevice(0)


def test_unset_by_a_process_that_did_not_publish_keeps_its_mapping(sim):
    kv = DeviceTensor(sim.malloc(4096), 4096, "gpu:0")
    ops.set_data_ipc(kv, "kv_theirs")
    run_child("""
        import numpy as np, pdhal
        from pdhal import ops
        shared = ops.share_external_data(np.zeros(1, np.uint8), "kv_theirs", [4096])
        try:
            ops.unset_data_ipc(shared, "kv_theirs", True, True)  # not this process's record
        except pdhal.InvalidArgumentError as e:
            assert "only its publisher unsets it" in str(e), e
        else:
            raise AssertionError("another process's record was removed")
        assert ops.copy_blocks(shared, [0], np.ones(64, np.uint8), [0], 64) == 1  # still mapped
        ops.synchronize()
    """)
