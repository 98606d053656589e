"""The connector and its messager with crc32 tracing, for the tests (costly): each KV head
of each prompt block as the prefill worker writes it, as its messager reads it once the
transfer landed, and as the decode worker holds it once each layer landed, each a "block"
event of the process's trace (the tests compare the three, wherever each side's
tensor-parallel split put the head).

An instance: kv_connector "CrcPdhalConnector", kv_connector_module_path
"pdhal_vllm.testing.crc", with a "trace" in its extra config. Its messager:
`python -m pdhal_vllm.testing.crc --trace PATH [the messager's options]`.
"""

from __future__ import annotations

import sys
import zlib

import numpy as np
import torch

from pdhal.transfer import rank_heads
from pdhal_vllm import messager
from pdhal_vllm.connector import PdhalConnector
from pdhal_vllm.decode_worker import DecodeWorker
from pdhal_vllm.prefill_worker import PrefillWorker
from pdhal_vllm.worker import Worker


def head_crcs(block, heads: int) -> list[int]:
    """crc32 of each of a head-major block's `heads` equal parts (the bytes of each KV
    head)."""
    data = memoryview(block).cast("B")
    size = len(data) // heads
    return [zlib.crc32(data[h * size : (h + 1) * size]) for h in range(heads)]


class CrcPrefillWorker(PrefillWorker):
    def save_layer(self, meta, index: int, kv_layer) -> None:
        """Each block this step wrote of layer `index`, then the layer's signal."""
        w = self.w
        bs, heads = w.block_size, w.layout[index][4]
        for store in meta.stores:
            for i in range(store["start"] // bs, -(-store["end"] // bs)):
                data = kv_layer[store["blocks"][i]].contiguous().view(torch.uint8).numpy()
                w.trace(
                    "block", tid=store["tid"], layer=index, i=i, head0=w.head0,
                    crcs=head_crcs(data, heads),
                )  # fmt: skip
        super().save_layer(meta, index, kv_layer)


class CrcDecodeWorker(DecodeWorker):
    def _landed(self, load, layers: int) -> None:
        """Each prompt block of each layer that landed, before a sync load's forward may
        see it (and write it)."""
        w = self.w
        whole = w.buffers[0][0]
        view = whole.as_numpy(np.uint8, (whole.nbytes,))
        for layer in range(load.layers, layers):
            offset, stride, nbytes, _, heads = w.layout[layer]
            for i, block in enumerate(load.blocks[load.cached :], load.cached):
                start = offset + block * stride
                crcs = head_crcs(view[start : start + nbytes], heads)
                w.trace("block", tid=load.tid, layer=layer, i=i, head0=w.head0, crcs=crcs)
        super()._landed(load, layers)


class CrcWorker(Worker):
    prefill_class = CrcPrefillWorker
    decode_class = CrcDecodeWorker


class CrcPdhalConnector(PdhalConnector):
    worker_class = CrcWorker


class CrcMessager(messager.Messager):
    def _outcome(self, outcome) -> None:
        """Each prompt block of a transfer that landed, in the prefill cache (which holds
        them until the prefill worker hears the transfer ended), then its outcome."""
        added = self.added.get(outcome.request_id)
        if outcome.landed and added is not None and self.trace.on:
            layout = self.service.layout
            source = layout.memory[0]
            head0 = rank_heads(self.prefill.hello["kv_heads"], self.prefill_ranks, self.rank)
            for layer, (spec,) in enumerate(layout.layers):
                for i, block in enumerate(added.blocks[: -(-added.prompt // self.block_size)]):
                    start = spec.offset + block * spec.stride
                    crcs = head_crcs(source[start : start + spec.block_bytes], spec.heads)
                    self.trace(
                        "block", tid=outcome.request_id, layer=layer, i=i, head0=head0.start,
                        crcs=crcs,
                    )  # fmt: skip
        super()._outcome(outcome)


if __name__ == "__main__":
    sys.exit(messager.main(None, CrcMessager))
