"""Memory named by tensors, arrays, DLPack objects and buffers is checked before pdhal reads
or writes it by address: contiguity, extent, dtype and writability, on every path."""

from __future__ import annotations

import array

import numpy as np
import pytest

import pdhal
from pdhal import ops


class DLPackOnly:
    """An object that names its memory through __dlpack__ alone (as many frameworks do)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def _pending_record() -> None:
    chunk = ops.init_kv_signal_per_query([4], [4], [0], 0, 1)
    ops.signal_layer_ready(chunk.layer(0))


@pytest.mark.parametrize(
    "out, words",
    [
        (np.zeros((1538, 2), np.int32)[:, 0], "strided view of shape .1538. with strides .8."),
        (np.broadcast_to(np.zeros(1, np.int32), (1538,)), "strides .0."),
        (DLPackOnly(np.zeros((1538, 2), np.int32)[:, 1]), "DLPack strides .2."),
    ],
)
def test_a_view_that_is_not_contiguous_is_refused_and_nothing_is_written(out, words):
    _pending_record()
    neighbours = out.array.base if isinstance(out, DLPackOnly) else np.asarray(out).base
    before = np.array(neighbours, copy=True)
    with pytest.raises(pdhal.InvalidArgumentError, match=f"must be contiguous.*{words}"):
        ops.get_output_kv_signal(out, 0, False)
    assert np.array_equal(neighbours, before)
    good = np.zeros(1538, np.int32)
    ops.get_output_kv_signal(good, 0, False)  # the record was not consumed by the refusal
    assert list(good[:5]) == [1, 0, 0, 0, 4]


@pytest.mark.parametrize("dtype", [np.float32, np.uint32, np.int64, np.int16])
def test_an_out_of_another_dtype_is_refused_even_when_its_size_fits(dtype):
    _pending_record()
    with pytest.raises(pdhal.InvalidArgumentError, match="must have dtype int32, got"):
        ops.get_output_kv_signal(np.zeros(1538 * 2, dtype), 0, False)


def test_a_read_only_out_is_refused():
    _pending_record()
    out = np.zeros(1538, np.int32)
    out.flags.writeable = False
    with pytest.raises(pdhal.InvalidArgumentError, match="read-only"):
        ops.get_output_kv_signal(out, 0, False)
    assert not out.any()


def test_a_dlpack_out_that_is_contiguous_is_written():
    _pending_record()
    out = np.zeros(1538, np.int32)
    ops.get_output_kv_signal(DLPackOnly(out), 0, False)
    assert list(out[:5]) == [1, 0, 0, 0, 4]


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (np.zeros(0, np.float32), pdhal.InvalidArgumentError, "empty"),
        (np.zeros((8, 8), np.float32)[:, 1], pdhal.InvalidArgumentError, "contiguous"),
        (np.array([None, 1], dtype=object), pdhal.InvalidArgumentError, "Python objects"),
        (DLPackOnly(np.array([1.0j], np.complex64)[:0]), pdhal.InvalidArgumentError, "empty"),
    ],
)
def test_peer_address_refuses_memory_it_cannot_name_whole(bad, error, words):
    with pytest.raises(error, match=words):
        ops.get_peer_mem_addr(bad)


def test_peer_address_of_read_only_memory_is_allowed():
    """A NIC registers memory it only reads from (the send side) too."""
    arr = np.arange(16, dtype=np.float32)
    arr.flags.writeable = False
    assert ops.get_peer_mem_addr(arr) == arr.ctypes.data


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**40])
def test_sequence_lengths_beyond_int32_are_refused(value):
    with pytest.raises(pdhal.InvalidArgumentError, match="does not fit the int32"):
        ops.init_kv_signal_per_query([value], [1], [0], 0, 4)
    with pytest.raises(pdhal.InvalidArgumentError, match="does not fit the int32"):
        ops.init_kv_signal_per_query([1], [1], [value], 0, 4)


def test_sharing_a_strided_view_is_refused():
    buf = ops.host_alloc(4096)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match="contiguous"):
            ops.set_data_ipc(buf.as_numpy(np.float32, (32, 32))[:, 3], "kv")
    finally:
        ops.host_free(buf)


@pytest.mark.paddle
def test_paddle_views_are_checked_before_any_write():
    """A stride-0 view over one int32 once got a 1538-word record written past its
    allocation; a strided column was written linearly into its neighbour."""
    import paddle

    _pending_record()
    one = paddle.zeros([1], "int32")
    with pytest.raises(pdhal.InvalidArgumentError, match="contiguous.*strides .0."):
        ops.get_output_kv_signal(paddle.as_strided(one, [1538], [0]), 0, False)
    table = paddle.zeros([1538, 3], "int32")
    with pytest.raises(pdhal.InvalidArgumentError, match="contiguous.*strides .3."):
        ops.get_output_kv_signal(table[:, 1], 0, False)
    assert int(table.abs().sum()) == 0 and one.tolist() == [0]
    with pytest.raises(pdhal.InvalidArgumentError, match="dtype int32, got float32"):
        ops.get_output_kv_signal(paddle.zeros([1538], "float32"), 0, False)
    with pytest.raises(pdhal.InvalidArgumentError, match="contiguous"):
        ops.get_peer_mem_addr(table[:, 1])
    out = paddle.zeros([1538], "int32")
    ops.get_output_kv_signal(out, 0, False)
    assert out[:5].tolist() == [1, 0, 0, 0, 4]


def test_array_module_and_bytearray_buffers_are_typed_by_their_format():
    _pending_record()
    with pytest.raises(pdhal.InvalidArgumentError, match="dtype int32, got uint8"):
        ops.get_output_kv_signal(bytearray(1538 * 4), 0, False)
    out = array.array("i", [0] * 1538)
    ops.get_output_kv_signal(out, 0, False)
    assert list(out[:5]) == [1, 0, 0, 0, 4]
