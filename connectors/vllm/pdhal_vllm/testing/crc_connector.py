"""The connector with crc32 tracing, for the tests (costly; pdhal_vllm.testing.crc says
what the traces hold): each block as the prefill worker writes it, and as the decode worker
holds it once each layer landed. An instance: kv_connector "CrcPdhalConnector",
kv_connector_module_path "pdhal_vllm.testing.crc_connector", with a "trace" in its extra
config."""

from __future__ import annotations

import numpy as np
import torch

from pdhal_vllm.connector import PdhalConnector
from pdhal_vllm.decode_worker import DecodeWorker
from pdhal_vllm.prefill_worker import PrefillWorker
from pdhal_vllm.testing.crc import head_crcs
from pdhal_vllm.worker import Worker


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
            offset, stride, nbytes, _, heads, _ = w.layout[layer]
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
