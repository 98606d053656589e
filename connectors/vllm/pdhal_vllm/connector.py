"""PdhalConnector: a vLLM v1 KV connector that streams prefill KV layer by layer through pdhal.

Prefill instance (kv_role "kv_producer"), per step that stores KV: the worker opens a pdhal
step, sends the step's table (request, transfer id, block ids, token range) to its cache
messager, and after each attention layer's save_kv_layer posts that layer's pdhal signal.
The messager (`python -m pdhal_vllm.messager`, another process) drives a
pdhal.transfer.KVStreamer from the tables and signals: it writes the layer's blocks into
the decode instance's cache while the next layers compute. A finished request's blocks stay
allocated until the messager reports its transfer ended (landed or failed).

Decode instance (kv_role "kv_consumer"): the worker holds a pdhal.transfer.KVReceiver over
vLLM's KV cache (transport "shm" or "mooncake", from the extra config). A request whose
kv_transfer_params say do_remote_prefill is matched for its prompt tokens; once vLLM
allocated its blocks, the worker expects it in the receiver and sends the messager named in
its params the ticket and the blocks ("want"; the receiver's description goes once, in the
connection's hello). Its outcome is read from the receiver's status slot (receiver.poll()),
never from a message. With load_mode "async" (default) the request waits in
WAITING_FOR_REMOTE_KVS and is scheduled in the step after it landed; with "sync" it is
scheduled at once and each attention layer waits, in wait_for_layer_load, for that layer
only (receiver.layers_landed). A load that fails (messager or prefill gone, a write failed,
load_timeout_s passed) is reported to vLLM as a failed receive: kv_load_failure_policy
"recompute" recomputes the request, "fail" fails it. Nothing is decoded on a partial cache.

Requests are paired by kv_transfer_params["pdhal_transfer_id"] (the same on both sides, set
by whoever routes the request), and the decode side needs "pdhal_messager" (HOST:PORT of
the prefill rank 0's messager) unless the connector's extra config names one.

Tensor parallelism: each prefill rank has its messager (rank r on rank 0's port + r); the
ranks of each side split the KV heads (vLLM's CPU cache is head-major: [blocks, heads, ...]),
which may split differently on the two sides (prefill TP 2, decode TP 1, ...). A decode rank
expects one part per prefill rank that holds heads it holds, each in its own ticket, from
that rank's messager; its load lands once every part did. A part has one name on both sides,
pdhal.transfer.part_id(transfer id, prefill rank, decode rank): this receiver's request and that
messager's streamer request (the streamer refuses a ticket issued under another name).

The KV cache must be memory the transports can reach: the connector places vLLM's KV cache
allocation in pdhal host memory (get_mem_pool_context); the prefill worker shares it with
the messager (set_data_ipc), the decode worker's receiver makes it reachable.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

import pdhal
from pdhal import InvalidArgumentError, PdhalError, TransferError, ops
from pdhal.transfer import CacheLayout, CacheSpec, KVReceiver, head_shards, part_id, rank_heads
from pdhal_vllm.wire import ConnectorError, Tracer, auth_key, connect, head_crcs

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

TRANSFER_ID = "pdhal_transfer_id"
MESSAGER = "pdhal_messager"


@dataclass
class PdhalConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, per step: what this step stores (prefill) and what to load."""

    stores: list[dict] = field(default_factory=list)
    loads: list[dict] = field(default_factory=list)
    #: decode: transfers it needs none of (its prefix cache holds the prompt): told to
    #: their messager at once, so the prefill side frees their blocks now
    unneeded: list[dict] = field(default_factory=list)
    #: decode: requests vLLM finished (aborted) while their KV was on its way: their
    #: messagers stop sending them, so their blocks come free now, not at the load timeout
    cancelled: list[str] = field(default_factory=list)


def _config(vllm_config: VllmConfig) -> dict:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    extra.setdefault("transport", "shm")
    extra.setdefault("load_mode", "async")
    extra.setdefault("load_timeout_s", 60.0)
    if extra["load_mode"] not in ("async", "sync"):
        raise ConnectorError(f"load_mode must be 'async' or 'sync', got {extra['load_mode']!r}")
    return extra


class PdhalConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._extra = _config(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self.is_producer = self._kv_transfer_config.is_kv_producer
        self.is_consumer = self._kv_transfer_config.is_kv_consumer
        self._sync = self._extra["load_mode"] == "sync"
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _Scheduler(self)
            self.worker = None
        else:
            self.scheduler = None
            self.worker = _Worker(self, vllm_config)

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
        return self.worker.results(finished_req_ids)

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


# ---- scheduler side -----------------------------------------------------------------------


class _Scheduler:
    """Bookkeeping: what each step stores, what to load, which blocks to hold."""

    def __init__(self, owner: PdhalConnector):
        self.o = owner
        self.stores: dict[str, dict] = {}  # prefill: req id -> transfer id, blocks, prompt
        self.new_loads: list[dict] = []
        self.new_unneeded: list[dict] = []
        self.new_cancelled: list[str] = []
        self.asked: set[str] = set()  # decode: req ids whose load was asked for (once)
        self.loading: set[str] = set()  # decode: req ids whose load has not ended

    def matched(self, request: Request, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if (
            not self.o.is_consumer
            or not params.get("do_remote_prefill")
            or request.request_id in self.asked
        ):
            return 0, False  # also after a failed load (asked): then vLLM recomputes
        if TRANSFER_ID not in params:
            raise ConnectorError(
                f"request {request.request_id} asks for remote prefill "
                f"without kv_transfer_params[{TRANSFER_ID!r}]"
            )
        count = len(request.prompt_token_ids or ()) - num_computed - (1 if self.o._sync else 0)
        if count <= 0:  # its prefix cache has what it needs: the prefill side hears so now
            self.asked.add(request.request_id)
            self.new_unneeded.append(
                {"tid": params[TRANSFER_ID], "messager": self._messager(request, params)}
            )
            return 0, False
        return count, not self.o._sync

    def _messager(self, request: Request, params: dict) -> str:
        messager = params.get(MESSAGER) or self.o._extra.get("messager")
        if not messager:
            raise ConnectorError(
                f"request {request.request_id}: no messager to load from (set "
                f"kv_transfer_params[{MESSAGER!r}] or the connector's "
                f"`messager`)"
            )
        return messager

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external <= 0 or not self.o.is_consumer:
            return
        params = request.kv_transfer_params or {}
        prompt = len(request.prompt_token_ids or ())
        total = prompt - (1 if self.o._sync else 0)
        messager = self._messager(request, params)
        self.asked.add(request.request_id)
        if not self.o._sync:  # a sync load ends within the step that scheduled it
            self.loading.add(request.request_id)
        self.new_loads.append(
            {
                "req": request.request_id,
                "tid": params[TRANSFER_ID],
                "messager": messager,
                "blocks": list(blocks.get_block_ids()[0]),
                "first_token": total - num_external,
                "num_tokens": total,
                "sync": self.o._sync,
            }
        )

    def build(self, out: SchedulerOutput) -> PdhalConnectorMetadata:
        meta = PdhalConnectorMetadata(
            loads=self.new_loads, unneeded=self.new_unneeded, cancelled=self.new_cancelled
        )
        self.new_loads, self.new_unneeded, self.new_cancelled = [], [], []
        if not self.o.is_producer:
            return meta
        for new in out.scheduled_new_reqs:
            params = (
                (new.sampling_params.extra_args or {}).get("kv_transfer_params")
                if new.sampling_params is not None
                else None
            )
            if not params or not params.get("do_remote_decode"):
                continue
            if TRANSFER_ID not in params:
                raise ConnectorError(
                    f"request {new.req_id} asks for remote decode without "
                    f"kv_transfer_params[{TRANSFER_ID!r}]"
                )
            state = self.stores[new.req_id] = {
                "tid": params[TRANSFER_ID],
                "blocks": list(new.block_ids[0]),
                "prompt_len": len(new.prompt_token_ids or ()),
            }
            self._store(
                meta,
                new.req_id,
                state,
                new.num_computed_tokens,
                out.num_scheduled_tokens[new.req_id],
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.stores.get(req_id)
            if state is None:
                continue
            if cached.new_block_ids[i] is not None:
                if req_id in cached.resumed_req_ids:
                    state["blocks"] = list(cached.new_block_ids[i][0])
                else:
                    state["blocks"] += cached.new_block_ids[i][0]
            self._store(
                meta, req_id, state, cached.num_computed_tokens[i], out.num_scheduled_tokens[req_id]
            )
        return meta

    @staticmethod
    def _store(meta, req_id: str, state: dict, computed: int, scheduled: int) -> None:
        end = min(computed + scheduled, state["prompt_len"])
        if end > computed:  # only prompt tokens go to the decode side
            meta.stores.append(
                {
                    "req": req_id,
                    "tid": state["tid"],
                    "blocks": state["blocks"],
                    "start": computed,
                    "end": end,
                    "prompt_len": state["prompt_len"],
                }
            )

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        state = self.stores.pop(request.request_id, None)
        if state is not None:  # hold the blocks until the messager wrote them (or gave up)
            return True, {TRANSFER_ID: state["tid"]}
        self.asked.discard(request.request_id)
        if request.request_id in self.loading:
            # finished (aborted) while its KV may still be landing: keep the blocks until
            # the load ends (landed, failed or timed out), so no write lands in a reused
            # block; its messagers are told to stop, so that is soon
            self.new_cancelled.append(request.request_id)
            return True, None
        return False, None

    def update_output(self, output) -> None:
        for req in output.finished_recving or ():
            self.loading.discard(req)


# ---- worker side --------------------------------------------------------------------------


def rank_address(rank0: str, rank: int) -> str:
    """The messager of prefill rank `rank`: one per rank, on ports in a row from rank 0's."""
    host, _, port = rank0.rpartition(":")
    return f"{host}:{int(port) + rank}"


#: Decode: how long a messager that refuses connections is retried, in the engine's step
#: (a messager that is down fails the loads that need it, never stalls the others).
LINK_CONNECT_S = 2.0
#: Prefill: how many transfers failed for want of a messager its successor is told of.
UNSENT_KEPT = 4096
#: Prefill: how often a restarted messager is looked for, once this rank's went.
MESSAGER_RETRY_S = 1.0
#: The longest sleep between two looks at a layer's progress (sync loads).
LAYER_POLL_S = 1e-3


@dataclass(eq=False)
class _Part:
    """The heads of a load that one prefill rank sends, in a receiver request of its own."""

    link: _MessagerLink | None = None  # the prefill rank's messager, once asked
    layers: int = 0  # layers landed, from the first
    error: str | None = None
    #: nothing can write it any more (its messager went, or said it will not send it): if
    #: the receiver holds its blocks (failed by its deadline), they are released
    unwritten: bool = False


@dataclass(eq=False)
class _Load:
    """A decode request's KV on its way, as one part per prefill rank sending heads this
    rank holds (one part without tensor parallelism). It ends once every part ended, so no
    write of a part still on its way meets blocks vLLM already gave to another request:
    landed if every part landed, failed otherwise."""

    req: str
    tid: str
    sync: bool
    blocks: list[int]
    cached: int  # the prompt's first blocks, in this cache already (a prefix it cached)
    parts: dict[str, _Part] = field(default_factory=dict)  # by pdhal.transfer.part_id
    layers: int = 0  # layers known to have landed in every part, from the first
    landed: bool = False
    error: str | None = None
    flagged: bool = False  # sync: its blocks were reported as load errors

    @property
    def done(self) -> bool:
        return self.landed or self.error is not None


def _answer(conn, address: str, timeout: float = 30.0) -> tuple:
    """The messager's answer to a hello: ("ready", ...) or ("error", why)."""
    if not conn.poll(timeout):
        raise ConnectorError(f"the messager at {address} did not answer within {timeout:.0f} s")
    try:
        return conn.recv()
    except (EOFError, OSError):
        raise ConnectorError(f"the messager at {address} closed the connection") from None


class _MessagerLink:
    """A decode worker's connection to one messager: wants go out on it; nothing comes back
    but a refusal. Its thread notices the connection drop, which fails the loads it carried."""

    def __init__(self, worker: _Worker, address: str):
        self.address = address
        self.worker = worker
        self.conn = connect(
            address,
            worker.key,
            {
                "role": "decode",
                "pid": os.getpid(),
                "rank": worker.rank,
                "ranks": worker.ranks,
                "kv_heads": worker.kv_heads,
                "described": worker.receiver.describe(),
                "block_size": worker.block_size,
            },
            timeout=LINK_CONNECT_S,
        )
        kind, payload = _answer(self.conn, address)
        if kind != "ready":
            raise ConnectorError(f"the messager at {address} refused this decode worker: {payload}")
        #: the tensor parallelism of the prefill instance it serves a rank of
        self.prefill_ranks = int(payload.get("prefill_ranks", 1))
        self.lock = threading.Lock()
        self.alive = True
        self.refusal: str | None = None
        threading.Thread(target=self._read, name="pdhal-vllm-link", daemon=True).start()

    def send(self, *message) -> None:
        with self.lock:
            self.conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed under us (shutdown)
                break
            if message[0] == "error":
                self.refusal = message[1]
            elif message[0] == "unserved":
                self.worker.on_unserved(self, message[1]["tid"], message[1]["why"])
        self.alive = False
        if self.worker.closing:
            return
        why = f"the messager at {self.address} is gone (its connection closed)"
        if self.refusal:
            why = f"the messager at {self.address} dropped this decode worker: {self.refusal}"
        self.worker.on_link_lost(self, why)


class _Worker:
    def __init__(self, owner: PdhalConnector, vllm_config: VllmConfig):
        self.o = owner
        self.extra = owner._extra
        self.block_size = owner._block_size
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
        #: the first of the KV heads this rank holds (of all the model's)
        self.head0 = rank_heads(self.kv_heads, self.ranks, self.rank).start
        self.trace = Tracer(self._trace_path())
        #: tests: crc32 of every block where it is written and where it lands (costly)
        self.trace_blocks = self.trace.on and bool(self.extra.get("trace_blocks"))
        self.key = auth_key(self.extra.get("auth_key"))
        self.buffers: list = []  # (host buffer, tensor) of the KV cache allocation
        self.layer_index: dict[str, int] = {}
        #: per layer: offset, stride, block bytes, blocks, KV heads of this rank
        self.layout: list[list[int]] = []
        #: guards the loads, the stored requests and what the messager said of them (the
        #: engine's thread, the links' readers and the messager's reader all touch them)
        self.lock = threading.RLock()
        # decode
        self.receiver: KVReceiver | None = None
        self.loads: dict[str, _Load] = {}  # req id -> load, until it is reported
        self.load_of: dict[str, _Load] = {}  # receiver's id (a part) -> its load
        self.links: dict[str, _MessagerLink] = {}
        self.load_error_blocks: set[int] = set()
        self.step_loads: list[_Load] = []
        # prefill
        self.messager = None
        self.meta = None  # the pdhal step of the current forward, once it stores
        self.sent: dict[str, str | None] = {}  # transfer id -> None (written) or the error
        self.req_of: dict[str, str] = {}  # transfer id -> request id, for stored requests
        self.finished_reqs: set[str] = set()
        #: transfers failed while no messager was there (the newest UNSENT_KEPT)
        self.unsent: collections.deque[str] = collections.deque(maxlen=UNSENT_KEPT)
        self.closing = False

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
        buf, whole = self.buffers[0]
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
            self.layout.append(
                [t.data_ptr() - base, t.stride(0) * size, block.numel() * size, t.shape[0], heads]
            )
        self.num_layers = len(names)
        logger.info(
            "pdhal connector: %d layers, KV cache %s (%d bytes) in pdhal memory, block %d bytes",
            self.num_layers,
            tuple(kv_caches[names[0]].shape),
            buf.nbytes,
            self.layout[0][2],
        )
        self.cache_name = f"pdhal-vllm.{os.getpid()}.{self.rank}"
        if self.o.is_producer:
            ops.set_data_ipc(whole, self.cache_name)
            # the channel exists, with an opening step, before the messager attaches
            ops.open_shm_and_get_meta_signal(self.rank, 0)
            self.messager_alive = False
            self.send_lock = threading.Lock()
            self._connect_messager(timeout=30.0)
        if self.o.is_consumer:
            # the mooncake transport reads its address and protocol from the environment
            for key, var in (
                ("mooncake_host", "PDHAL_MOONCAKE_HOST"),
                ("mooncake_protocol", "PDHAL_MOONCAKE_PROTOCOL"),
            ):
                if self.extra.get(key):
                    os.environ[var] = str(self.extra[key])
            layout = CacheLayout([buf], [[CacheSpec(0, *layer)] for layer in self.layout])
            try:
                self.receiver = KVReceiver(
                    layout, self.cache_name, transport_name=self.extra["transport"]
                )
            except PdhalError as exc:
                raise ConnectorError(
                    f"the decode worker cannot receive over {self.extra['transport']!r}: {exc}"
                ) from None

    def _messager_address(self) -> str:
        address = self.extra.get("messager")
        if not address:
            raise ConnectorError(
                "a prefill instance needs kv_connector_extra_config "
                "['messager'] = 'HOST:PORT' of its cache messager"
            )
        return rank_address(address, self.rank)

    def _connect_messager(self, timeout: float) -> None:
        """Say hello to this rank's messager (the KV cache, its layout), and read what it
        reports on a thread of its own. `timeout`: how long one that refuses connections
        is retried (one that accepted has 30 s to answer)."""
        address = self._messager_address()
        conn = connect(
            address,
            self.key,
            {
                "role": "prefill",
                "pid": os.getpid(),
                "rank": self.rank,
                "ranks": self.ranks,
                "kv_heads": self.kv_heads,
                "cache": self.cache_name,
                "nbytes": self.buffers[0][0].nbytes,
                "layers": self.layout,
                "block_size": self.block_size,
                # their decode side may ask the new messager for them: it answers at once
                "failed": list(self.unsent),
            },
            timeout=timeout,
        )
        try:
            kind, payload = _answer(conn, address)
        except ConnectorError:
            conn.close()  # else it would hold the messager for this worker: closed, it is free
            raise
        if kind != "ready":
            conn.close()
            raise ConnectorError(
                f"the messager at {address} refused this prefill worker: {payload}"
            )
        with self.send_lock:
            self.messager, self.messager_alive = conn, True
        threading.Thread(
            target=self._read_messager, args=(conn,), name="pdhal-vllm-messager", daemon=True
        ).start()

    # ---- prefill: signals ----------------------------------------------------------------

    def save_layer(self, meta: PdhalConnectorMetadata, layer_name: str, kv_layer) -> None:
        if not meta.stores or not self.o.is_producer:
            return
        index = self.layer_index[layer_name]
        if self.meta is None:
            self._open_step(meta)
        if self.trace_blocks:
            self._trace_blocks(meta, index, kv_layer)
        posted = time.monotonic_ns()
        ops.signal_layer_ready(ops.init_signal_layerwise(self.meta, index))
        self.trace("signal", step=self.meta.step, layer=index, t=posted)

    def _open_step(self, meta: PdhalConnectorMetadata) -> None:
        """The first layer of a step that stores KV: a new pdhal step, its table first."""
        if not self.messager_alive:
            logger.error(
                "pdhal connector: the cache messager is gone; %d request(s) of this "
                "step will not reach the decode side",
                len(meta.stores),
            )
        self.meta = ops.open_shm_and_get_meta_signal(self.rank, 0)
        with self.lock:  # (the messager's reader walks req_of when it goes)
            for store in meta.stores:
                self.req_of[store["tid"]] = store["req"]
        # not a later chunk of a request that ended (failed while no messager was there)
        table = [
            {k: s[k] for k in ("tid", "blocks", "start", "end", "prompt_len")}
            for s in meta.stores
            if s["tid"] not in self.sent
        ]
        with self.send_lock:  # (messager and messager_alive change under it only)
            try:
                self.messager.send(("table", self.meta.step, table))
            except OSError:
                self.messager_alive = False
        self.trace("table", step=self.meta.step, tids=[s["tid"] for s in table])
        if not self.messager_alive:
            with self.lock:
                for store in meta.stores:
                    self._messager_gone(store["tid"])

    def _trace_blocks(self, meta, index: int, kv_layer) -> None:
        bs, heads = self.block_size, self.layout[index][4]
        for store in meta.stores:
            for i in range(store["start"] // bs, -(-store["end"] // bs)):
                data = kv_layer[store["blocks"][i]].contiguous().view(torch.uint8).numpy()
                crcs = head_crcs(data, heads)
                self.trace("block", tid=store["tid"], layer=index, i=i, head0=self.head0, crcs=crcs)

    def end_step(self) -> None:
        self.meta = None

    def _read_messager(self, conn) -> None:
        """What the messager on `conn` reports: each transfer's end. Once it is gone, the
        transfers it had not ended are released as failed, and its successor (a messager
        restarted at the same address) is looked for every MESSAGER_RETRY_S."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError, TypeError):
                break
            if message[0] in ("sent", "failed"):
                with self.lock:
                    self.sent[message[1]] = None if message[0] == "sent" else message[2]
                if message[0] == "failed":
                    logger.error("pdhal connector: transfer %s failed: %s", message[1], message[2])
                self.trace(message[0], tid=message[1])
        with self.send_lock:
            if self.messager is conn:  # (not a successor's, connected meanwhile)
                self.messager_alive = False
        if self.closing:
            return
        logger.error(
            "pdhal connector: the cache messager of rank %d is gone: the requests it "
            "had not written are released, their decode side reports them failed",
            self.rank,
        )
        self.trace("error", error="messager gone")
        with self.lock:
            for tid in self.req_of:
                if tid not in self.sent:
                    self._messager_gone(tid)
        while not self.closing:
            time.sleep(MESSAGER_RETRY_S)
            try:
                self._connect_messager(timeout=MESSAGER_RETRY_S)
            except (ConnectorError, OSError, EOFError, AuthenticationError):
                continue  # not back yet
            logger.warning("pdhal connector: rank %d's cache messager is back", self.rank)
            self.trace("messager_back")
            return

    def _messager_gone(self, tid: str) -> None:
        """Transfer `tid` failed for want of a messager: its blocks are released, and the
        next messager is told, so a decode rank that asks it for `tid` hears so at once."""
        self.sent[tid] = "the cache messager is gone"
        self.unsent.append(tid)

    # ---- decode: loads -------------------------------------------------------------------

    def start_load(self, meta: PdhalConnectorMetadata) -> None:
        """Expect each new load in the receiver, a part per prefill rank that sends this
        rank heads, and ask each part's messager for it. In sync mode, and with a trace,
        the prefill side also reports each layer as it lands."""
        self.step_loads = []
        for req in meta.cancelled:
            self._cancel(req)
        for spec in meta.unneeded:
            try:
                for rank in self._sources(spec["messager"]):
                    link = self._link(rank_address(spec["messager"], rank))
                    link.send("unneeded", {"tid": spec["tid"]})
                self.trace("unneeded", tid=spec["tid"])
            except (ConnectorError, OSError, PdhalError) as exc:
                # its claim timeout frees the blocks
                logger.error("pdhal connector: %s", exc)
        for spec in meta.loads:
            load = _Load(
                spec["req"],
                spec["tid"],
                spec["sync"],
                spec["blocks"],
                spec["first_token"] // self.block_size,
            )
            with self.lock:
                self.loads[load.req] = load
            if load.sync:
                self.step_loads.append(load)
            try:
                sources = self._sources(spec["messager"])
            except (ConnectorError, OSError, PdhalError) as exc:
                load.parts[load.req] = _Part()
                self._end_part(load, load.req, str(exc))
                continue
            for rank in sources:
                with self.lock:
                    load.parts[part_id(load.tid, rank, self.rank)] = _Part()
            for rank in sources:
                self._ask(load, spec, rank)

    def _cancel(self, req: str) -> None:
        """vLLM finished `req` while its load was on its way: ask the messager of each part
        not ended to stop. Each part then ends (failed, or landed if all of it went), and
        vLLM frees the blocks once every part ended."""
        with self.lock:
            load = self.loads.get(req)
            if load is None or load.done:
                return
            links = {p.link for p in load.parts.values() if p.link is not None and p.error is None}
        self.trace("cancelled", tid=load.tid)
        for link in links:
            try:
                link.send("cancel", {"tid": load.tid})
            except OSError:  # the link's reader ends its parts as it drops
                pass

    def _sources(self, messager: str) -> list[int]:
        """The prefill ranks that send this rank KV heads, for the prefill instance whose
        rank 0's messager is at `messager` (its answer says the instance's TP)."""
        ranks = self._link(messager).prefill_ranks
        shards = head_shards(self.kv_heads, ranks, self.ranks)
        return sorted(src for src, dst in shards if dst == self.rank)

    def _ask(self, load: _Load, spec: dict, rank: int) -> None:
        """Expect the part of `load` that prefill rank `rank` sends; ask its messager."""
        pid = part_id(load.tid, rank, self.rank)
        part = load.parts[pid]
        try:
            ticket = self.receiver.expect(
                pid,
                timeout=float(self.extra["load_timeout_s"]),
                layerwise=load.sync or self.trace.on,
            )
            with self.lock:
                self.load_of[pid] = load
            part.link = self._link(rank_address(spec["messager"], rank))
            part.link.send(
                "want",
                {
                    "tid": load.tid,
                    "ticket": ticket,
                    "blocks": load.blocks,
                    "num_tokens": spec["num_tokens"],
                    "cached_blocks": load.cached,
                },
            )
            self.trace("want", tid=load.tid, req=load.req, rank=rank)
        except (ConnectorError, OSError, PdhalError) as exc:
            self._end_part(load, pid, str(exc))

    def _link(self, address: str) -> _MessagerLink:
        """The connection to the messager at `address`, opened once (again if it closed)."""
        link = self.links.get(address)
        if link is None or not link.alive:
            link = self.links[address] = _MessagerLink(self, address)
        return link

    def _progress(self, load: _Load) -> None:
        """Read how many layers of each part of `load` landed (the receiver's status
        slots), ending the parts that failed."""
        if load.done:
            return
        for pid, part in list(load.parts.items()):
            if part.error is not None or part.layers == self.num_layers:
                continue
            try:
                layers = self.receiver.layers_landed(pid)
            except TransferError as exc:
                self._end_part(load, pid, str(exc))
                continue
            except InvalidArgumentError:
                continue  # its outcome went to poll() already: results() ends it
            self._part_landed(load, pid, layers)

    def _part_landed(self, load: _Load, pid: str, layers: int) -> None:
        with self.lock:
            part = load.parts[pid]
            part.layers = max(part.layers, layers)
            self._settle(load)

    def _end_part(self, load: _Load, pid: str, why: str) -> None:
        """Part `pid` of `load` failed: nothing more of it lands."""
        with self.lock:
            part = load.parts[pid]
            if part.error is not None or part.layers == self.num_layers:
                return
            part.error = why
            self._settle(load)
        logger.error("pdhal connector: loading request %s failed: %s", load.req, why)
        self.trace("load_failed", tid=load.tid, error=why)

    def _settle(self, load: _Load) -> None:
        """What the parts of `load` say of it: the layers landed in all of them; ended once
        every part ended. Called under self.lock."""
        if load.done:
            return
        layers = min(p.layers for p in load.parts.values())
        for layer in range(load.layers, layers):
            self.trace("landed", tid=load.tid, layer=layer)
            if self.trace_blocks:  # before a sync load's forward may see it, and write it
                self._trace_landed(load, layer)
        load.layers = max(load.layers, layers)
        parts = load.parts.values()
        if all(p.error is not None or p.layers == self.num_layers for p in parts):
            errors = [p.error for p in parts if p.error is not None]
            if errors:
                load.error = "; ".join(errors)
            else:
                load.landed = True

    def _trace_landed(self, load: _Load, layer: int) -> None:
        """crc32 of each head of each block of `load` in `layer`, as it landed."""
        whole = self.buffers[0][0]
        view = whole.as_numpy(np.uint8, (whole.nbytes,))
        off, stride, nbytes, _, heads = self.layout[layer]
        for i in range(load.cached, len(load.blocks)):
            start = off + load.blocks[i] * stride
            crcs = head_crcs(view[start : start + nbytes], heads)
            self.trace("block", tid=load.tid, layer=layer, i=i, head0=self.head0, crcs=crcs)

    def on_unserved(self, link: _MessagerLink, tid: str, why: str) -> None:
        """The messager at `link` will not send its part of transfer `tid`."""
        with self.lock:
            parts = [
                (load, pid)
                for load in self.loads.values()
                if load.tid == tid
                for pid, part in load.parts.items()
                if part.link is link
            ]
        for load, pid in parts:
            load.parts[pid].unwritten = True
            self._end_part(load, pid, f"the messager at {link.address} will not send it: {why}")

    def on_link_lost(self, link: _MessagerLink, why: str) -> None:
        """The messager `link` went to is gone: what landed of its parts before stays
        landed, the rest fails now (nothing more can come), not after the load timeout."""
        with self.lock:
            lost = [
                (load, pid)
                for load in self.loads.values()
                for pid, part in load.parts.items()
                if part.link is link
            ]
        for load, pid in lost:
            load.parts[pid].unwritten = True
            if not load.done:
                self._progress(load)
                self._end_part(load, pid, why)

    def wait_layer(self, layer_name: str) -> None:
        """Sync loads: return once layer `layer_name` of each of this step's loads is in the
        cache, or its load failed (its blocks then go to vLLM as load errors)."""
        if not self.step_loads:
            return
        index = self.layer_index[layer_name]
        for load in self.step_loads:
            nap = 50e-6
            while not load.done and load.layers <= index:
                self._progress(load)
                if load.done or load.layers > index:
                    break
                time.sleep(nap)  # bounded: the receiver fails the load by its timeout
                nap = min(2 * nap, LAYER_POLL_S)
            if load.error is not None and not load.flagged:
                load.flagged = True
                self.load_error_blocks.update(load.blocks[load.cached :])

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        held: set[str] = set()
        if self.receiver is not None:
            for outcome in self.receiver.poll():
                load = self.load_of.pop(outcome.request_id, None)
                if load is None:
                    continue  # ended here already (its messager went)
                if outcome.landed:
                    self._part_landed(load, outcome.request_id, self.num_layers)
                else:
                    self._end_part(load, outcome.request_id, outcome.reason)
            if self.trace.on:  # each layer of an async load as it lands
                with self.lock:
                    pending = [x for x in self.loads.values() if not x.done]
                for load in pending:
                    self._progress(load)
            held = self._held()
        with self.lock:
            for req, load in list(self.loads.items()):
                if not load.done or (not load.sync and held.intersection(load.parts)):
                    continue  # (a held part: its blocks are vLLM's again once freed)
                del self.loads[req]
                for pid in load.parts:
                    if self.load_of.get(pid) is load:  # (another load of its tid may hold it)
                        del self.load_of[pid]
                if load.sync:
                    continue  # reported per layer, through load_errors
                out.finished_recving.add(req)
                if load.error is not None:
                    out.failed_recving.add(req)
            # prefill: a finished request is released once its transfer is written or failed
            self.finished_reqs |= finished_req_ids
            stored = {req: tid for tid, req in self.req_of.items()}
            for req in list(self.finished_reqs):
                tid = stored.get(req)
                if tid is None:
                    self.finished_reqs.discard(req)  # never stored: nothing to wait for
                    continue
                if tid in self.sent:
                    out.finished_sending.add(req)
                    self.finished_reqs.discard(req)
                    del self.sent[tid], self.req_of[tid]
        return out

    def _held(self) -> set[str]:
        """The parts the receiver holds: failed by their deadline while their prefill side
        may still write them (one that stalled, not one that died). An async load is
        reported once none of its parts is held, so no late write meets blocks vLLM gave
        to another request. Released here, as nothing can write them any more: the parts
        whose messager went or will not send them, and those of loads reported already.
        A sync load's blocks are vLLM's as soon as it fails (load errors, recomputed in
        that very step): for those the receiver's hold cannot be kept, and is released."""
        held = set(self.receiver.held())
        if held:
            with self.lock:
                owners = {
                    pid: (load, part)
                    for load in self.loads.values()
                    for pid, part in load.parts.items()
                }
            for pid in list(held):
                load, part = owners.get(pid, (None, None))
                if load is None or load.sync or part.unwritten:
                    held.discard(pid)
                    with contextlib.suppress(InvalidArgumentError):  # its word came meanwhile
                        self.receiver.release(pid)
        self.receiver.freed()  # (it names each let go once; held() is what counts here)
        return held

    def load_errors(self) -> set[int]:
        errors, self.load_error_blocks = self.load_error_blocks, set()
        return errors

    def shutdown(self) -> None:
        self.closing = True
        for link in self.links.values():
            with contextlib.suppress(OSError):
                link.conn.close()
        if self.messager is not None:
            with contextlib.suppress(OSError):
                self.messager.close()
        if self.receiver is not None:
            with contextlib.suppress(PdhalError):
                self.receiver.close()
