"""The prefill half of a worker (pdhal_vllm.prefill_worker.PrefillWorker) on a stand-in for
the worker it belongs to, no engine: a second prefill instance whose layer signals would
share a channel with a live one's (same rank, device and namespace) is refused when it
starts, naming what to change, instead of both posting on one channel."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pdhal_vllm.prefill_worker import PrefillWorker
from pdhal_vllm.wire import ConnectorError

from pdhal import ops

DEVICE = 6


def test_a_prefill_instance_on_a_channel_another_holds_is_refused_naming_the_fix():
    holder = subprocess.Popen(  # a live prefill instance's channel, in this namespace
        [
            sys.executable,
            "-c",
            "import sys; from pdhal import ops\n"
            f"ops.open_shm_and_get_meta_signal(0, {DEVICE}); print('held', flush=True)\n"
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    buffer = ops.host_alloc(4096)
    worker = SimpleNamespace(
        extra={"messager": "127.0.0.1:9"},
        rank=0,
        device=DEVICE,
        buffers=[(buffer, torch.from_numpy(buffer.as_numpy(np.int8, (4096,))))],
        cache_name="pdhal-vllm.test.0",
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(
            ConnectorError,
            match=r"another prefill instance on this host signals its layers as rank 0 of "
            rf"device {DEVICE} .*PDHAL_CPU_VISIBLE_DEVICES.*PDHAL_NAMESPACE",
        ):
            PrefillWorker(worker)
    finally:
        holder.stdin.close()
        holder.wait(30)
        ops.unset_data_ipc(None, worker.cache_name)
        ops.host_free(buffer)
