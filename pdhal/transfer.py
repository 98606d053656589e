"""Layer-wise KV transfer from a prefill instance's caches to a decode instance's, as
library API: the loop every PD engine writes around pdhal's layer signals.

    # decode side
    receiver = transfer.KVReceiver(transfer.CacheLayout.from_caches(layers), "decode0")
    send_to_prefill(receiver.describe(), receiver.expect("req-1", timeout=30), my_blocks)
    outcome = receiver.wait("req-1")        # or receiver.poll() once per scheduler step

    # prefill side (the cache messager)
    streamer = transfer.KVStreamer(transfer.CacheLayout.from_caches(layers), block_tokens=64)
    streamer.add_request("req-1", src_blocks, prompt_tokens)
    streamer.set_destination("req-1", streamer.connect(described), dst_blocks, ticket)
    streamer.layer_ready(layer, [("req-1", tokens_in_cache)])   # on each layer signal
    for outcome in streamer.poll(): ...     # free the blocks of what ended

Transports are plugins (`shm` built in; entry-point group `pdhal.transports`, hook
`pdhal_transport`); docs/api.md has the failure semantics and the numbers.
"""

from pdhal._transfer.contract import (
    COMPLETIONS,
    Batch,
    Endpoint,
    Gate,
    Link,
    Run,
    RunChecker,
    Transport,
    described_numbers,
    region_bytes,
    region_devices,
    require_target_completion,
)
from pdhal._transfer.control import Frames, authenticate
from pdhal._transfer.feeds import PerChunkFeed, PerQueryFeed
from pdhal._transfer.heads import HeadShard, head_shards, rank_heads
from pdhal._transfer.keeper import Clock
from pdhal._transfer.kit import (
    BatchState,
    EngineTransport,
    LandedBatch,
    LatchedLink,
    Option,
    PollingBatch,
    Registrations,
    nap_until,
    one_of,
    positive,
    word,
)
from pdhal._transfer.layout import (
    BlockRuns,
    CacheLayout,
    CacheSpec,
    LayerCopies,
    RunPlanner,
    block_runs,
)
from pdhal._transfer.metrics import LayerRecord, RequestRecord, TransferMetrics
from pdhal._transfer.outcome import Outcome
from pdhal._transfer.plugins import names as transports
from pdhal._transfer.plugins import transport
from pdhal._transfer.receiver import KVReceiver
from pdhal._transfer.session import (
    DecodeClient,
    PrefillService,
    abandon,
    part_id,
    rank_address,
    request_of,
)
from pdhal._transfer.streamer import Destination, KVStreamer

__all__ = [
    "COMPLETIONS",
    "Batch",
    "BatchState",
    "BlockRuns",
    "CacheLayout",
    "CacheSpec",
    "Clock",
    "DecodeClient",
    "Destination",
    "Endpoint",
    "EngineTransport",
    "Frames",
    "Gate",
    "HeadShard",
    "KVReceiver",
    "KVStreamer",
    "LandedBatch",
    "LatchedLink",
    "LayerCopies",
    "LayerRecord",
    "Link",
    "Option",
    "Outcome",
    "PerChunkFeed",
    "PerQueryFeed",
    "PollingBatch",
    "PrefillService",
    "Registrations",
    "RequestRecord",
    "Run",
    "RunChecker",
    "RunPlanner",
    "Transport",
    "TransferMetrics",
    "abandon",
    "authenticate",
    "block_runs",
    "described_numbers",
    "head_shards",
    "nap_until",
    "one_of",
    "part_id",
    "positive",
    "rank_address",
    "request_of",
    "region_bytes",
    "rank_heads",
    "region_devices",
    "require_target_completion",
    "transport",
    "transports",
    "word",
]
