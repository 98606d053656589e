"""Exporting mapped memory as DLPack (SharedDeviceBuffer.__dlpack__, what
paddle.from_dlpack / torch.from_dlpack call on a peer's cache mapped here): the capsule names
the device the mapping is on, the dtype and the shape; the mapping stays alive while a
consumer holds it, and is let go once the consumer (or an unconsumed capsule) is gone."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from simulators import DeviceTensor, SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal._inputs import dlpack as _dlpack
from pdhal._memory.published import SharedDeviceBuffer


def _dl_tensor(capsule) -> _dlpack.DLTensor:
    """The DLTensor a consumer reads from a "dltensor" capsule."""
    return _dlpack.DLManagedTensor.from_address(_dlpack.capsule_pointer(capsule)).dl_tensor


@pytest.mark.simulated
def test_a_peer_s_cache_mapped_on_device_1_is_exported_as_device_1(monkeypatch):
    sim = SimRuntime("cuda", "libcudart_sim.so")
    monkeypatch.setenv("PDHAL_CUDART", sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", "cuda")
    _registry.reset()
    assert pdhal.current_backend() == "cuda"
    address = sim.malloc(4096)
    ops.set_data_ipc(DeviceTensor(address, 4096, "gpu:0"), "kv_dlpack")
    rt = _registry.selection().candidate.backend.runtime
    assert rt.lib.cudaSetDevice(1) == 0
    try:
        shared = ops.share_external_data("bfloat16", "kv_dlpack", [4, 8, 64])
    finally:
        rt.lib.cudaSetDevice(0)
    capsule = shared.__dlpack__()
    t = _dl_tensor(capsule)
    assert (t.device.device_type, t.device.device_id) == (2, 1) == shared.__dlpack_device__()
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (4, 16, 1)  # kDLBfloat
    assert [t.shape[i] for i in range(t.ndim)] == [4, 8, 64] and not t.strides
    assert t.data == shared.address and t.byte_offset == 0


def test_the_mapping_lives_while_a_consumer_holds_it_and_no_longer():
    host = ops.host_alloc(64)
    try:
        host.memoryview()[:] = bytes(range(64))
        buffer = SharedDeviceBuffer(host.address, (4, 16), "uint8", 64, "cpu")
        alive = weakref.ref(buffer)
        array = np.from_dlpack(buffer)  # numpy consumes the capsule
        del buffer
        gc.collect()
        assert alive() is not None, "the exporter died while a consumer held its memory"
        assert array[3, 15] == 63 and array.shape == (4, 16)
        del array
        gc.collect()
        assert alive() is None, "the exporter outlived the consumer"
        unconsumed = SharedDeviceBuffer(host.address, (64,), "uint8", 64, "cpu")
        alive = weakref.ref(unconsumed)
        capsule = unconsumed.__dlpack__()
        del unconsumed
        gc.collect()
        assert alive() is not None
        del capsule  # never handed to a consumer: its destructor lets go
        gc.collect()
        assert alive() is None, "an unconsumed capsule kept the exporter alive"
    finally:
        ops.host_free(host)
