"""PdhalConnector: a vLLM v1 KV connector that streams prefill KV layer by layer through pdhal.

Prefill instance (kv_role "kv_producer"), per step that stores KV: the worker opens a pdhal
step, sends the step's table (request, transfer id, block ids, token range) to its cache
messager, and after each attention layer's save_kv_layer posts that layer's pdhal signal.
The messager (`python -m pdhal_vllm.messager`, another process) serves that cache with a
pdhal.transfer.PrefillService: it writes each layer's blocks into the decode instances'
caches while the next layers compute. A finished request's blocks stay allocated until the
messager reports its transfer ended (landed or failed).

Decode instance (kv_role "kv_consumer"): the worker holds a pdhal.transfer.KVReceiver over
vLLM's KV cache (transport "shm", "mooncake", "nixl", any installed plugin, from the extra
config) and a pdhal.transfer.DecodeClient. A request whose kv_transfer_params say
do_remote_prefill is matched for its prompt tokens; once vLLM allocated its blocks, the
worker claims it at the messager named in its params (pdhal's session protocol: the hello
checks both sides' layouts, splits, transports and key once). Its outcome is read from the
receiver's status slots, never from a message. With load_mode "async" (default) the request
waits in WAITING_FOR_REMOTE_KVS and is scheduled in the step after it landed; with "sync" it
is scheduled at once and each attention layer waits, in wait_for_layer_load, for that layer
only. A load that fails (messager or prefill gone, a write failed, load_timeout_s passed) is
reported to vLLM as a failed receive: kv_load_failure_policy "recompute" recomputes the
request, "fail" fails it. Nothing is decoded on a partial cache.

Requests are paired by kv_transfer_params["pdhal_transfer_id"] (the same on both sides, set
by whoever routes the request), and the decode side needs "pdhal_messager" (HOST:PORT of
the prefill rank 0's messager) unless the connector's extra config names one.

Tensor parallelism: each prefill rank has its messager (rank r on rank 0's port + r); the
ranks of each side split the KV heads (vLLM's CPU cache is head-major: [blocks, heads, ...]),
which may split differently on the two sides, and differently for each decode instance.

The package: this facade (what vLLM calls), scheduler.Scheduler (the scheduler process's
books), worker.Worker (the KV cache in pdhal memory) with prefill_worker.PrefillWorker and
decode_worker.DecodeWorker, the messager, and metadata (what the two sides share).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

from pdhal_vllm.config import extra_config, idle_spin_advice
from pdhal_vllm.metadata import MESSAGER, TRANSFER_ID, PdhalConnectorMetadata
from pdhal_vllm.scheduler import Scheduler
from pdhal_vllm.worker import Worker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["MESSAGER", "TRANSFER_ID", "PdhalConnector", "PdhalConnectorMetadata"]

logger = init_logger(__name__)


class PdhalConnector(KVConnectorBase_V1):
    #: The worker side (the tests' subclass traces more).
    worker_class = Worker

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._extra = extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._block_size = vllm_config.cache_config.block_size
        self.is_producer = self._kv_transfer_config.is_kv_producer
        self.is_consumer = self._kv_transfer_config.is_kv_consumer
        self._sync = self._extra["load_mode"] == "sync"
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = Scheduler(self)
            self.worker = None
            parallel = vllm_config.parallel_config
            advice = idle_spin_advice(parallel.distributed_executor_backend, parallel.world_size)
            if self.is_consumer and advice is not None:
                logger.warning("pdhal connector: %s", advice)
        else:
            self.scheduler = None
            self.worker = self.worker_class(self, vllm_config)

    # ---- worker side ----------------------------------------------------------------------

    def get_mem_pool_context(self):
        return self.worker.allocation_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any
    ) -> None:
        self.worker.save_layer(self._get_connector_metadata(), layer_name, kv_layer)

    def wait_for_save(self):
        self.worker.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.results(finished_req_ids, self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return (0,)
