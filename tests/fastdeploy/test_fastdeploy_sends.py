"""FastDeploy's ipc_sent_key_value_cache_by_remote_ptr sends block_num blocks: the first
block_num ids of each list, which FastDeploy may pass longer than that (ids of blocks not
ready yet, or padding). The decode side, in another process, sees exactly those blocks."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from pdhal.testing.fixtures import python_child

BLOCK, BLOCKS = 32, 6

RECEIVER = f"""
import sys
import numpy as np
from pdhal import ops
from pdhal.compat import fastdeploy as fd
caches = []
for name in ("key_caches_0_rank0.device0", "value_caches_0_rank0.device0"):
    buf = ops.host_alloc({BLOCK * BLOCKS})
    buf.memoryview()[:] = bytes({BLOCK * BLOCKS})
    fd.set_data_ipc(buf.as_numpy("uint8", ({BLOCKS}, {BLOCK})), name)
    caches.append(buf)
print("published", flush=True)
sys.stdin.readline()
for buf in caches:  # the first byte of each block
    print(list(bytes(buf.memoryview())[::{BLOCK}]), flush=True)
"""


@pytest.mark.paddle
def test_only_the_first_block_num_blocks_are_sent():
    paddle = pytest.importorskip("paddle")
    from pdhal.compat import fastdeploy as fd

    receiver = python_child(RECEIVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline() == "published\n"
        key = np.repeat(np.arange(1, BLOCKS + 1, dtype=np.uint8), BLOCK).reshape(BLOCKS, BLOCK)
        value = key + 100
        tmp = paddle.ones([1, 1])
        remote_k = fd.get_data_ptr_ipc(tmp, "key_caches_0_rank0.device0", timeout=30)
        remote_v = fd.get_data_ptr_ipc(tmp, "value_caches_0_rank0.device0", timeout=30)
        local_ids = paddle.to_tensor([0, 1, 2, 3], dtype="int32", place="cpu")
        remote_ids = paddle.to_tensor([5, 4, 3, 2], dtype="int32", place="cpu")
        fd.ipc_sent_key_value_cache_by_remote_ptr(
            key, value, local_ids, remote_ids, remote_k, remote_v, 2, 0, 0, 0
        )
        fd.ipc_sent_key_value_cache_by_remote_ptr_block_sync(key, value, 0)
        out, _ = receiver.communicate("sent\n", timeout=60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    assert receiver.returncode == 0
    assert out.splitlines() == ["[0, 0, 0, 0, 2, 1]", "[0, 0, 0, 0, 102, 101]"]
