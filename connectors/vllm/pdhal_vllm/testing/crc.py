"""crc32 tracing of KV blocks, for the tests (costly): each KV head of each prompt block, as
a "block" event of the process's trace (the tests compare, per head, where the prefill
worker wrote it, where its messager read it once the transfer landed, and where the decode
worker holds it, wherever each side's tensor-parallel split put the head).

This module is the messager's side and imports no vLLM: `python -m pdhal_vllm.testing.crc
--trace PATH [the messager's options]`. The workers' side is
pdhal_vllm.testing.crc_connector (kv_connector "CrcPdhalConnector").
"""

from __future__ import annotations

import sys
import zlib

from pdhal.transfer import rank_heads
from pdhal_vllm import messager


def head_crcs(block, heads: int) -> list[int]:
    """crc32 of each of a head-major block's `heads` equal parts (the bytes of each KV
    head)."""
    data = memoryview(block).cast("B")
    size = len(data) // heads
    return [zlib.crc32(data[h * size : (h + 1) * size]) for h in range(heads)]


class CrcMessager(messager.Messager):
    def _outcome(self, outcome) -> None:
        """Each prompt block of a transfer that landed, in the prefill cache (which holds
        them until the prefill worker hears the transfer ended), then its outcome."""
        added = self.added.get(outcome.request_id)
        if outcome.landed and added is not None and self.trace.on:
            layout = self.service.layout
            source = layout.memory[0]
            head0 = rank_heads(self.prefill.hello["kv_heads"], self.prefill_ranks, self.rank)
            for layer, caches in enumerate(layout.layers):
                # a block: each head's K and V, whichever specs describe them
                first = min(caches, key=lambda spec: spec.offset)
                whole = sum(spec.block_bytes for spec in caches)
                for i, block in enumerate(added.blocks[: -(-added.prompt // self.block_size)]):
                    start = first.offset + block * first.stride
                    crcs = head_crcs(source[start : start + whole], first.heads)
                    self.trace(
                        "block", tid=outcome.request_id, layer=layer, i=i, head0=head0.start,
                        crcs=crcs,
                    )  # fmt: skip
        super()._outcome(outcome)


if __name__ == "__main__":
    sys.exit(messager.main(None, CrcMessager))
