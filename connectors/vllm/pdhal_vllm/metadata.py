"""What the connector's scheduler side and worker side share: the kv_transfer_params keys,
the per-step metadata, and the connector's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pdhal_vllm.wire import KEEPALIVE_S, ConnectorError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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


#: The keys of kv_connector_extra_config, and their defaults (docs/engines/vllm.md).
EXTRA_CONFIG = {
    "messager": None,  # prefill: its messager's HOST:PORT; decode: the one to claim at
    "transport": "shm",  # decode: any installed transport
    "transport_options": {},  # decode: the transport's options (Transport.configure)
    "load_mode": "async",
    "load_timeout_s": 60.0,
    "keepalive_s": KEEPALIVE_S,
    "auth_key": None,
    "trace": None,
    "trace_blocks": False,
}


def config(vllm_config: VllmConfig) -> dict:
    """kv_connector_extra_config, its defaults filled in and checked."""
    given = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(given) - set(EXTRA_CONFIG))
    if unknown:
        raise ConnectorError(
            f"kv_connector_extra_config has no key {', '.join(map(repr, unknown))}: it takes "
            f"{', '.join(EXTRA_CONFIG)}"
            + (
                " (a transport's settings go in transport_options, e.g. {'host': ...})"
                if any(key.startswith(("mooncake_", "nixl_")) for key in unknown)
                else ""
            )
        )
    extra = {**EXTRA_CONFIG, **given}
    if extra["load_mode"] not in ("async", "sync"):
        raise ConnectorError(f"load_mode must be 'async' or 'sync', got {extra['load_mode']!r}")
    if not isinstance(extra["transport_options"], dict):
        raise ConnectorError(
            f"transport_options must be a JSON object of the transport's options, got "
            f"{extra['transport_options']!r}"
        )
    return extra
