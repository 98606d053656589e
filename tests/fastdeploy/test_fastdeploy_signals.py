"""FastDeploy adopts pdhal: producer code shaped like FastDeploy's attention backends and
model runners, and a C attention op shaped like FastDeploy's (tests/c/attention_op.c, built
against pdhal.h, loaded with ctypes, no Python inside), post layer signals through pdhal's
kernel form on the simulated CUDA and XPU runtimes (pdhal-cuda, pdhal-xpu); a messager shaped like
FastDeploy's, in another process, maps the producer's KV caches by name and checks that it
sees every layer (main model and MTP draft) once, in order, and never before its bytes.

The model: NUM_LAYERS layers plus an MTP draft model of NUM_LAYERS_DRAFT layers whose layer
signals continue the numbering (keep_pd_step_flag=True, start_layer_index=NUM_LAYERS), as
FastDeploy's draft backend is configured. Requests arrive in waves, one per batch slot, and
are prefilled in chunks (a chunk writes whole blocks of each layer's K and V caches; every
request owns its blocks, so bytes once written stay), each wave followed by a decode-only
step, which posts nothing. The op queues each layer's block writes on the stream as a
"kernel" that writes after a delay, then posts the layer: cudaLaunchHostFunc(stream,
pdhal_store_run, pdhal_signal_store(kv_signal_data)) per query, pdhal_next_chunk_layer_store()
per chunk; on XPU an event recorded after the writes, posted with the store to the sender
named by create_kv_signal_sender's tensor (one sender per step, as the newer
xpu_model_runner does).

Tests marked paddle use pdhal.compat.fastdeploy exactly as FastDeploy imports it (its kernel
forms are Paddle CPU tensors). The drop tests use no Paddle, so that `make sanitize` runs
them under ASan: the engine frees a layer's kernel-form words (malloc'd, overwritten, freed)
right after the launch, while a gate holds the stream, so every host function and sender
store runs after the free; the gate is opened from C holding the GIL, so those posts also
prove that no Python runs on the post path.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import numpy as np
import pytest
from fastdeploy_shapes import (
    DEVICE_ID,
    RANK,
    RUNTIMES,
    AttentionOp,
    Device,
    Dropped,
    Kept,
    KVWrite,
    PrefillWorker,
    build_op,
    run_steps,
    start_messager,
)
from simulators import SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal._protocol import core as _core
from pdhal._protocol import signals as _signals
from pdhal.compat import fastdeploy as fd


@pytest.fixture(params=[pytest.param(kind, marks=pytest.mark.simulated) for kind in RUNTIMES])
def device(request, monkeypatch, tmp_path_factory):
    kind = request.param
    variable, library, _ = RUNTIMES[kind]
    sim = SimRuntime(kind, library)
    monkeypatch.setenv(variable, sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", kind)
    _registry.reset()
    assert pdhal.current_backend() == kind
    folder = tmp_path_factory.getbasetemp() / "attention_op"
    folder.mkdir(exist_ok=True)
    yield Device(kind, sim, AttentionOp(kind, build_op(kind, sim.path, folder)))
    sim.device.release()


MODES = ["per_query", "per_chunk"]


@pytest.mark.paddle
@pytest.mark.parametrize("mode", MODES)
def test_fastdeploy_shaped_backends_post_through_the_c_op(device, mode):
    """The compat module as FastDeploy imports it, Paddle CPU tensors as kernel forms, the C
    op posting each layer of the main and the draft model; CacheMessager /
    CacheMessagerV1 in another process (per chunk polling on CUDA, get_output_kv_signal's
    wait_flag 0 as CacheMessagerV1 passes it, and blocking on XPU)."""
    worker = PrefillWorker(device, mode, Kept())
    messager = start_messager(worker, paddle=True, wait_flag=int(device.kind == "xpu"))
    events = device.live_events()
    run_steps(worker, messager)
    assert device.live_events() == events, "an XPU event was leaked"
    assert fd._senders == {}, "a per-step sender was left alive"


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_drops_the_kernel_form_right_after_the_launch(device, mode):
    """Each layer's signal words and the sender's words live in malloc'd memory that is
    overwritten and freed right after the launch (ASan sees any later read), the step's
    seq_lens are overwritten once published; a gate holds the stream until the step is
    launched, so every post runs after the frees, and nothing of the step is visible before.
    The gate opens from C holding the GIL: the posts (host functions, the sender's thread)
    run no Python."""
    worker = PrefillWorker(device, mode, Dropped())
    messager = start_messager(worker, paddle=False)
    events = device.live_events()
    try:
        run_steps(worker, messager)
    finally:
        if worker.reader is not None:
            worker.reader.close()
    assert device.live_events() == events, "an XPU event was leaked"


# ---- bad kernel forms --------------------------------------------------------------------


def _words(values) -> np.ndarray:
    return np.array([v - (1 << 64) if v >= 1 << 63 else v for v in values], np.int64)


def test_bad_kernel_forms_are_refused_with_the_reason_never_a_crash(device):
    """Garbage, a stale signal (its channel closed), a sender's words after destroy: the
    op's call gets NULL from pdhal and returns an error whose reason pdhal_last_error
    gives; nothing is stored, no event is left; from Python signal_layer_ready raises."""
    op, stream = device.op, device.stream()
    xpu = device.kind == "xpu"
    stale_meta = fd.open_shm_and_get_meta_signal(0, 0)
    stale = np.frombuffer(ops.init_signal_layerwise(stale_meta, 0).kernel_form, np.int64).copy()
    _signals.close_producer_channels()  # the engine restarted its channel: words go stale
    meta = fd.open_shm_and_get_meta_signal(0, 0)
    good = np.frombuffer(ops.init_signal_layerwise(meta, 0).kernel_form, np.int64).copy()
    sender = ops.create_kv_signal_sender() if xpu else None
    sender_words = None if sender is None else np.frombuffer(sender.kernel_form, np.int64)
    sender_ptr = None if sender is None else sender_words.ctypes.data
    channel, step_word = int(good[1]), int(good[3])
    bad = {
        "garbage": (
            np.random.default_rng(7).integers(-(1 << 63), (1 << 63) - 1, 4, dtype=np.int64),
            "not a layer signal's kernel form",
        ),
        "zeros": (np.zeros(4, np.int64), r"not a layer signal's kernel form \(tag 0\)"),
        "a sender's words": (
            _words([_core.KERNEL_SENDER, 1, 0, 0]),
            "not a layer signal's kernel form",
        ),
        "stale": (stale, r"names channel \d+, which this process does not produce \(closed"),
        "another generation": (
            _words([_core.KERNEL_SIGNAL, channel + (1 << 16), _core.QUERY_SLOT, step_word]),
            "which this process does not produce",
        ),
        "an index past the table": (
            _words([_core.KERNEL_SIGNAL, channel | 0xFFFF, _core.QUERY_SLOT, step_word]),
            "which this process does not produce",
        ),
        "a negative slot": (
            _words([_core.KERNEL_SIGNAL, channel, -5, step_word]),
            r"corrupt layer signal words \(slot -5",
        ),
        "a ring slot on a per-query channel": (
            _words([_core.KERNEL_SIGNAL, channel, 3, step_word]),
            "slot 3 is not a progress slot",
        ),
        "value 0": (
            _words([_core.KERNEL_SIGNAL, channel, _core.QUERY_SLOT, 0]),
            "corrupt layer signal words",
        ),
    }
    events = device.live_events()
    with ops.open_kv_signal_reader(0, 0) as reader:
        before = reader.current()
        for what, (words, reason) in bad.items():
            rc = op.per_query(stream, (KVWrite * 0)(), words.ctypes.data, sender_ptr)
            assert rc == -errno.EINVAL, (what, rc)
            assert _matches(reason, op.last_error()), (what, op.last_error())
            with pytest.raises(pdhal.PdhalError):  # from Python too (on XPU the event it
                fd.signal_layer_ready(words, stream, sender)  # recorded is destroyed queued)
        rc = op.per_query(stream, (KVWrite * 0)(), None, sender_ptr)
        assert rc == -errno.EINVAL and _matches(r"no signal words \(NULL\)", op.last_error())
        if not xpu:  # the header's launch line, unchecked: pdhal_store_run(NULL) is a no-op
            for words, _ in bad.values():
                assert op.lib.attention_cuda_unchecked(stream, words.ctypes.data) == 0
        else:  # the header's post line, unchecked: the post says why, the event is gone
            for what, (words, reason) in bad.items():
                rc = op.lib.attention_xpu_post_line(stream, words.ctypes.data, sender_ptr)
                assert rc == -errno.EINVAL, (what, rc)
                assert _matches(
                    r"no store to post \(the signal could not be prepared: .*" + reason,
                    op.last_error(),
                ), (what, op.last_error())
        ops.synchronize(stream)
        assert reader.current() == before, "a refused kernel form stored something"
        assert device.live_events() == events, "a refused post left its event"
        # the stream and the sender still work: the good words post
        assert op.per_query(stream, (KVWrite * 0)(), good.ctypes.data, sender_ptr) == 0
        assert reader.wait(before, timeout=10) == (meta.step, 0)
    if xpu:
        ops.destroy_kv_signal_sender(sender)
        layer1 = np.frombuffer(ops.init_signal_layerwise(meta, 1).kernel_form, np.int64)
        for what, words, reason in (
            ("destroyed", sender_words, r"the words name sender \d+, which is not alive"),
            ("garbage", _words([1, 2, 3, 4]), "not a sender's kernel form"),
            ("a signal's words", good, "not a sender's kernel form"),
        ):
            rc = op.per_query(stream, (KVWrite * 0)(), layer1.ctypes.data, words.ctypes.data)
            assert rc == -errno.EINVAL and _matches(reason, op.last_error()), (
                what,
                rc,
                op.last_error(),
            )
        rc = op.per_query(stream, (KVWrite * 0)(), layer1.ctypes.data, None)
        assert rc == -errno.EINVAL and "not a sender's kernel form" in op.last_error()
        # the header's post line: no live sender is -EBADF, the event left to the caller
        rc = op.lib.attention_xpu_post_line(stream, layer1.ctypes.data, sender_words.ctypes.data)
        assert rc == -errno.EBADF and "which is not alive" in op.last_error()
        with pytest.raises(pdhal.InvalidArgumentError, match="names no sender alive"):
            fd.signal_layer_ready(layer1, stream, sender_words)  # the sender's tensor
        assert device.live_events() == events, "a refused post left its event"


def test_a_per_chunk_layer_outside_a_step_is_refused_with_the_reason(device):
    """The op's "next layer" when no step is current (a decode-only step: no prefill
    request; a step whose channel was closed since) or after the step's last layer: an
    error with the reason, nothing stored."""
    op, stream = device.op, device.stream()
    sender = ops.create_kv_signal_sender() if device.kind == "xpu" else None
    sender_words = None if sender is None else np.frombuffer(sender.kernel_form, np.int64)
    sender_ptr = None if sender is None else sender_words.ctypes.data
    events = device.live_events()
    messager = subprocess.Popen(
        [
            sys.executable,
            "-c",
            """if True:
        import array, json
        from pdhal.compat import fastdeploy as fd
        x = array.array("i", [-1] * 1538)
        records = []
        for _ in range(2):
            fd.get_output_kv_signal(x, 0, 1, timeout=30)
            records.append(list(x[:5]))
        fd.get_output_kv_signal(x, 0, 0)
        records.append(list(x[:2]))
        print(json.dumps(records))
    """,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    fd.init_kv_signal_per_query([0, 0], [1, 1], [9, 9], 0, 2)  # decode only
    assert op.per_chunk(stream, (KVWrite * 0)(), sender_ptr) == -errno.EINVAL
    assert "no per-chunk step is current" in op.last_error(), op.last_error()
    fd.init_kv_signal_per_query([0, 7], [1, 7], [9, 0], 0, 2)
    for _ in range(2):
        assert op.per_chunk(stream, (KVWrite * 0)(), sender_ptr) == 0
    assert op.per_chunk(stream, (KVWrite * 0)(), sender_ptr) == -errno.EINVAL
    assert "has 2 layers, and all were posted already" in op.last_error(), op.last_error()
    ops.synchronize(stream)
    assert json.loads(messager.communicate(timeout=60)[0]) == [
        [1, 0, 1, 0, 7],
        [1, 1, 1, 0, 7],
        [-1, -1],
    ]
    # stale: a step of a channel since closed (the engine restarted it) takes no layer
    fd.init_kv_signal_per_query([5, 0], [5, 1], [0, 9], 0, 4)
    _signals.close_producer_channels()
    assert op.per_chunk(stream, (KVWrite * 0)(), sender_ptr) == -errno.EINVAL
    assert "no per-chunk step is current" in op.last_error(), op.last_error()
    if sender is not None:
        ops.destroy_kv_signal_sender(sender)
    assert device.live_events() == events


@pytest.mark.paddle
def test_compat_tensors_gone_stale_are_refused(device):
    """FastDeploy's own tensors: a kv_signal_data tensor kept past its channel's close, and
    a sender tensor after destroy_kv_signal_sender."""
    op, stream = device.op, device.stream()
    meta = fd.open_shm_and_get_meta_signal(RANK, DEVICE_ID, False)
    kv_signal_data = fd.init_signal_layerwise(meta, 0)
    sender = fd.create_kv_signal_sender()
    fd.destroy_kv_signal_sender(sender)
    if device.kind == "xpu":
        assert (
            op.per_query(stream, (KVWrite * 0)(), kv_signal_data.data_ptr(), sender.data_ptr())
            == -errno.EINVAL
        )
        assert "which is not alive" in op.last_error(), op.last_error()
        with pytest.raises(pdhal.InvalidArgumentError, match="names no sender alive"):
            fd.signal_layer_ready(kv_signal_data, stream, sender)
    _signals.close_producer_channels()
    live = fd.create_kv_signal_sender() if device.kind == "xpu" else None
    try:
        rc = op.per_query(
            stream,
            (KVWrite * 0)(),
            kv_signal_data.data_ptr(),
            None if live is None else live.data_ptr(),
        )
        assert rc == -errno.EINVAL and "which this process does not produce" in op.last_error()
        if live is None:  # on XPU pdhal refuses it after recording an event: see above
            with pytest.raises(pdhal.InvalidArgumentError, match="does not produce"):
                fd.signal_layer_ready(kv_signal_data, stream, live)
    finally:
        if live is not None:
            fd.destroy_kv_signal_sender(live)


def _matches(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None
