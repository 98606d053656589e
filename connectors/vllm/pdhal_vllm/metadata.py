"""What the connector's scheduler side and worker side share: the kv_transfer_params keys
and the per-step metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: kv_transfer_params: the id pairing a request's prefill and decode (both sides, set by
#: whoever routes it), and the prefill instance's messager (HOST:PORT of its rank 0's)
TRANSFER_ID = "pdhal_transfer_id"
MESSAGER = "pdhal_messager"


@dataclass
class PdhalConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: what this step stores (prefill) and what to load."""

    stores: list[dict] = field(default_factory=list)
    loads: list[dict] = field(default_factory=list)
    #: decode: transfers it needs none of (its prefix cache holds the prompt): claimed as
    #: cached at once, so the prefill side frees their blocks now
    unneeded: list[dict] = field(default_factory=list)
    #: decode: requests vLLM finished (aborted) while their KV was on its way: their
    #: prefill ranks stop sending them, so their blocks come free now, not at the load timeout
    cancelled: list[str] = field(default_factory=list)
    #: prefill: transfers of requests vLLM aborted (their client went, or the router's
    #: decode request failed) or ended in an error: failed at once, so their blocks come
    #: free now, not at the messager's claim timeout, and a decode side that claims one
    #: hears so at once
    abandoned: list[str] = field(default_factory=list)
    #: vLLM scheduled no token this step (its requests wait for their KV, or for nothing):
    #: a decode worker waits a moment for a load to end (DecodeWorker.results), so the
    #: engine does not run empty step after empty step while the KV is on its way
    idle: bool = False
