"""The connector's scheduler side: which requests a step stores (prefill) or loads (decode),
and which blocks stay held until their transfer ended. It runs in vLLM's scheduler process
and only keeps books: every byte and every message is the worker side's.

A request's kv_transfer_params are a client's word, checked here. It never raises into vLLM's
scheduler for them: an exception there ends the engine core, every request with it. A request
whose params are wrong is refused alone, logged naming what was wrong: a decode instance
computes its prompt itself, a prefill instance sends its KV nowhere."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from pdhal_vllm.metadata import MESSAGER, TRANSFER_ID, PdhalConnectorMetadata
from pdhal_vllm.wire import ConnectorError, checked_address

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from pdhal_vllm.connector import PdhalConnector


log = logging.getLogger(__name__)

#: how a prefill request ends when nobody will decode it: its transfer fails at once
ABANDONED = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


def _transfer_id(req_id: str, params: dict, remote: str) -> str:
    """The request's transfer id from its kv_transfer_params (a client's word: checked)."""
    tid = params.get(TRANSFER_ID)
    if tid is None:
        raise ConnectorError(
            f"request {req_id} asks for remote {remote} without kv_transfer_params[{TRANSFER_ID!r}]"
        )
    if not isinstance(tid, str) or not tid:
        raise ConnectorError(
            f"request {req_id}: kv_transfer_params[{TRANSFER_ID!r}] must be a non-empty "
            f"string, got {tid!r}"
        )
    return tid


class Scheduler:
    """Bookkeeping: what each step stores, what to load, which blocks to hold."""

    def __init__(self, owner: PdhalConnector):
        self.o = owner
        self.stores: dict[str, dict] = {}  # prefill: req id -> transfer id, blocks, prompt
        self.new_loads: list[dict] = []
        self.new_unneeded: list[dict] = []
        self.new_cancelled: list[str] = []
        self.new_abandoned: list[str] = []
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
        try:  # (before vLLM allocates its blocks)
            tid = _transfer_id(request.request_id, params, "prefill")
            messager = self._messager(request, params)
        except ConnectorError as e:  # the client's word: this request alone is refused
            self.asked.add(request.request_id)
            log.warning("pdhal connector: %s; it is computed here instead", e)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed - (1 if self.o._sync else 0)
        if count <= 0:  # its prefix cache has what it needs: the prefill side hears so now
            self.asked.add(request.request_id)
            self.new_unneeded.append(
                {
                    "tid": tid,
                    "messager": messager,
                    "num_tokens": len(request.prompt_token_ids or ()) - self.o._sync,
                }
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
        return checked_address(
            messager, f"request {request.request_id}: kv_transfer_params[{MESSAGER!r}]"
        )

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
                "tid": _transfer_id(request.request_id, params, "prefill"),
                "messager": messager,
                "blocks": list(blocks.get_block_ids()[0]),
                "first_token": total - num_external,
                "num_tokens": total,
                "sync": self.o._sync,
            }
        )

    def build(self, out: SchedulerOutput) -> PdhalConnectorMetadata:
        meta = PdhalConnectorMetadata(
            loads=self.new_loads,
            unneeded=self.new_unneeded,
            cancelled=self.new_cancelled,
            abandoned=self.new_abandoned,
            idle=out.total_num_scheduled_tokens == 0,
        )
        self.new_loads, self.new_unneeded, self.new_cancelled, self.new_abandoned = [], [], [], []
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
            try:  # (none given, as vLLM's proxy asks: it is named here, and said at its end)
                tid = (
                    _transfer_id(new.req_id, params, "decode")
                    if TRANSFER_ID in params
                    else f"pdhal-{new.req_id}"
                )
            except ConnectorError as e:  # the client's word: this request alone is refused
                log.warning("pdhal connector: %s; its KV goes to no decode side", e)
                continue
            state = self.stores[new.req_id] = {
                "tid": tid,
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
                    "blocks": list(state["blocks"]),  # (this step's: the next one adds)
                    "start": computed,
                    "end": end,
                    "prompt_len": state["prompt_len"],
                }
            )

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        state = self.stores.pop(request.request_id, None)
        if state is not None:  # hold the blocks until the messager wrote them (or gave up)
            if request.status in ABANDONED:
                self.new_abandoned.append(state["tid"])
            # what its decode side is to be asked with (a proxy passes them on)
            return True, {
                "do_remote_prefill": True,
                TRANSFER_ID: state["tid"],
                MESSAGER: self.o._extra["messager"],
            }
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
