"""The connector's scheduler side (pdhal_vllm.scheduler.Scheduler, through the PdhalConnector
methods vLLM's scheduler calls) on vLLM's own data objects, no engine, no worker, no
messager: a real PdhalConnector of role SCHEDULER built from a real VllmConfig (no model:
building one takes a millisecond once vLLM is imported), real vllm.v1.request.Request
objects carrying kv_transfer_params as a server request's body gives them
(SamplingParams.extra_args), KVCacheBlocks of plain KVCacheBlock ids, and SchedulerOutput /
KVConnectorOutput values made as vLLM's scheduler and workers make them.

Decode side: which prompt tokens a request loads (async: every one not cached; sync: one
less), once; what goes to the worker in each step's metadata, once; blocks held while a
finished request's load may still land. Prefill side: which prompt tokens of which blocks
each step stores; a finished request's blocks held until its transfer ended, and an aborted
or failed one's transfer abandoned at once. kv_transfer_params come from the HTTP client or
the router, so a wrong one is refused at the call that gets it, naming what is wrong.
"""

from __future__ import annotations

import functools
import logging
import re

import pytest
from pdhal_vllm.config import kv_transfer_config
from pdhal_vllm.connector import PdhalConnector
from pdhal_vllm.metadata import MESSAGER, TRANSFER_ID, PdhalConnectorMetadata
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

PROMPT = [7 * i % 990 + 2 for i in range(100)]
CACHED = 32  # the block-aligned prefix-cache hit vLLM reports (one block of 32 tokens)
BLOCKS = (10, 11, 12, 13)  # the request's blocks once allocated, its cached one first
PREFILL_MESSAGER = "127.0.0.1:47100"
DROP = object()  # a kv_transfer_params value: leave the key out


@functools.cache
def _vllm_config(role: str, load_mode: str, messager: str | None) -> VllmConfig:
    extra = {"load_mode": load_mode} | ({"messager": messager} if messager else {})
    return VllmConfig(kv_transfer_config=KVTransferConfig(**kv_transfer_config(role, **extra)))


def connector(
    role: str = "kv_consumer", load_mode: str = "async", messager: str | None = None
) -> PdhalConnector:
    """The scheduler-side connector of an instance of `role` (its extra config's `messager`
    and `load_mode`), as vLLM's scheduler makes it."""
    return PdhalConnector(_vllm_config(role, load_mode, messager), KVConnectorRole.SCHEDULER)


def request(req_id: str = "req-1", params: dict | None = None, prompt=PROMPT) -> Request:
    """A vLLM request with `params` as its kv_transfer_params (DROP values left out)."""
    if params is not None:
        params = {key: value for key, value in params.items() if value is not DROP}
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(req_id, list(prompt), SamplingParams(max_tokens=8, extra_args=extra), None)


def decode_request(req_id: str = "req-1", prompt=PROMPT, **params) -> Request:
    """A request routed to the decode instance: `params` over the router's."""
    routed = {"do_remote_prefill": True, TRANSFER_ID: f"t-{req_id}", MESSAGER: PREFILL_MESSAGER}
    return request(req_id, routed | params, prompt)


def prefill_request(req_id: str = "req-1", **params) -> Request:
    """A request routed to the prefill instance: `params` over the router's."""
    return request(req_id, {"do_remote_decode": True, TRANSFER_ID: f"t-{req_id}"} | params)


def blocks(ids=BLOCKS) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def step(conn: PdhalConnector, out: SchedulerOutput | None = None) -> PdhalConnectorMetadata:
    """The metadata of one step (`out`: what vLLM scheduled in it; default nothing)."""
    return conn.build_connector_meta(out or SchedulerOutput.make_empty())


def allocate(conn: PdhalConnector, req: Request, computed: int = CACHED) -> int:
    """vLLM's scheduling of a waiting `req` with `computed` tokens in its prefix cache: the
    connector's match, then its blocks. The number of tokens it loads."""
    count, _ = conn.get_num_new_matched_tokens(req, computed)
    conn.update_state_after_alloc(req, blocks(), count)
    return count


def new_step(req: Request, block_ids, scheduled: int) -> SchedulerOutput:
    """A step that schedules `req`'s first `scheduled` tokens into `block_ids`."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (list(block_ids),))]
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


def cached_step(
    req_id: str, computed: int, scheduled: int, new_blocks=None, resumed: bool = False
) -> SchedulerOutput:
    """A later step of a scheduled request: `scheduled` tokens after `computed`, with
    `new_blocks` allocated for them (`resumed`: after a preemption, its blocks all new)."""
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[req_id],
        resumed_req_ids={req_id} if resumed else set(),
        new_token_ids=[[]],
        all_token_ids={},
        new_block_ids=[None if new_blocks is None else (list(new_blocks),)],
        num_computed_tokens=[computed],
        num_output_tokens=[0],
    )
    out.num_scheduled_tokens = {req_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


def finish(conn: PdhalConnector, req: Request, status: RequestStatus, block_ids=BLOCKS):
    """vLLM finishing `req` with `status`: what the connector says (hold the blocks?,
    kv_transfer_params for the client)."""
    req.status = status
    return conn.request_finished(req, list(block_ids))


# ---- decode side: what a request loads --------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [None, {TRANSFER_ID: "t-1", MESSAGER: PREFILL_MESSAGER}, {"do_remote_prefill": False}],
    ids=["no-params", "no-flag", "flag-false"],
)
def test_a_request_without_do_remote_prefill_loads_nothing(params):
    """Any request not routed for a remote prefill is computed by vLLM alone."""
    conn = connector()
    assert conn.get_num_new_matched_tokens(request(params=params), CACHED) == (0, False)
    meta = step(conn)
    assert meta.loads == [] and meta.unneeded == []


def test_a_prefill_instance_loads_nothing():
    """kv_producer: a request with do_remote_prefill is computed there, not loaded."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    assert conn.get_num_new_matched_tokens(decode_request(), CACHED) == (0, False)


def computed_here(conn: PdhalConnector, req: Request, caplog, said: str) -> None:
    """`req`'s params are refused: never an exception into vLLM's scheduler (which would
    end its engine core, every request with it), but a warning saying `said`; the request
    is computed here, nothing is loaded, and it is not asked again."""
    with caplog.at_level(logging.WARNING, logger="pdhal_vllm"):
        assert conn.get_num_new_matched_tokens(req, CACHED) == (0, False)
    assert re.search(said, caplog.text), caplog.text
    conn.update_state_after_alloc(req, blocks(), 0)
    assert step(conn).loads == []
    assert conn.get_num_new_matched_tokens(req, CACHED) == (0, False)


def test_a_remote_prefill_without_a_transfer_id_is_computed_here_naming_why(caplog):
    conn = connector()
    req = decode_request("req-9", **{TRANSFER_ID: DROP})
    computed_here(conn, req, caplog, rf"request req-9 .*{TRANSFER_ID}.*computed here")


@pytest.mark.parametrize(
    "load_mode, answer", [("async", (100 - CACHED, True)), ("sync", (100 - CACHED - 1, False))]
)
def test_a_load_asks_for_the_uncached_prompt_tokens_one_less_in_sync_mode(load_mode, answer):
    """async: every prompt token not cached, loaded asynchronously; sync: the last prompt
    token is vLLM's own to compute, and the load is in the step."""
    conn = connector(load_mode=load_mode)
    assert conn.get_num_new_matched_tokens(decode_request(), CACHED) == answer


def test_a_request_not_allocated_yet_is_matched_again_the_same():
    """vLLM asks again in a later step when it found no blocks for the request."""
    conn = connector()
    first = conn.get_num_new_matched_tokens(decode_request(), CACHED)
    assert conn.get_num_new_matched_tokens(decode_request(), CACHED) == first == (68, True)
    assert step(conn).loads == []


def test_a_request_whose_prefix_cache_holds_the_prompt_is_reported_unneeded_once():
    """sync mode, 33 prompt tokens, 32 cached: nothing to load; the prefill side is told at
    once (so it frees its blocks now), and only once."""
    conn = connector(load_mode="sync")
    req = decode_request(prompt=PROMPT[:33])
    assert conn.get_num_new_matched_tokens(req, 32) == (0, False)
    conn.update_state_after_alloc(req, blocks(BLOCKS[:2]), 0)
    meta = step(conn)
    assert meta.unneeded == [{"tid": "t-req-1", "messager": PREFILL_MESSAGER, "num_tokens": 32}]
    assert meta.loads == []
    assert conn.get_num_new_matched_tokens(req, 32) == (0, False)
    assert step(conn).unneeded == []


def test_a_request_whose_load_failed_is_not_asked_again():
    """After a failed load vLLM recomputes the request: it is matched for nothing."""
    conn = connector()
    req = decode_request()
    assert allocate(conn, req) == 68
    step(conn)
    conn.update_connector_output(
        KVConnectorOutput(finished_recving={"req-1"}, failed_recving={"req-1"})
    )
    assert conn.get_num_new_matched_tokens(req, CACHED) == (0, False)
    assert step(conn).loads == []


# ---- decode side: what goes to the worker -----------------------------------------------


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_an_allocated_load_goes_into_the_next_steps_metadata_exactly_once(load_mode):
    """Its request, transfer, messager (from the params), every block of the request and
    the prompt's tokens from the first not cached (sync: up to the last but one)."""
    sync = load_mode == "sync"
    conn = connector(load_mode=load_mode)
    allocate(conn, decode_request())
    assert step(conn).loads == [
        {
            "req": "req-1",
            "tid": "t-req-1",
            "messager": PREFILL_MESSAGER,
            "blocks": list(BLOCKS),
            "first_token": CACHED,
            "num_tokens": 100 - sync,
            "sync": sync,
        }
    ]
    assert step(conn).loads == []


def test_a_step_that_schedules_no_token_is_marked_idle_for_the_worker():
    """(the decode worker waits in an idle step for a load to end, never in a busy one)"""
    conn = connector()
    req = decode_request()
    allocate(conn, req)
    assert step(conn).idle
    assert not step(conn, cached_step(req.request_id, 100, 1)).idle


def test_the_messager_is_the_connectors_own_when_the_params_name_none():
    conn = connector(messager="10.0.0.2:47100")
    allocate(conn, decode_request(**{MESSAGER: DROP}))
    assert [load["messager"] for load in step(conn).loads] == ["10.0.0.2:47100"]


def test_a_request_allocated_without_external_tokens_loads_nothing():
    """vLLM calls update_state_after_alloc for every request it allocates."""
    conn = connector()
    conn.update_state_after_alloc(decode_request(), blocks(), 0)
    assert step(conn).loads == []


def test_a_remote_prefill_without_any_messager_is_never_loaded(caplog):
    """Neither the params nor the connector name a messager: refused, naming the request
    and the key to set, before vLLM allocates its blocks."""
    conn = connector()
    req = decode_request("req-7", **{MESSAGER: DROP})
    computed_here(conn, req, caplog, rf"request req-7: no messager .*{MESSAGER}")


# ---- decode side: a request that finishes -----------------------------------------------


def test_a_request_finished_while_loading_holds_its_blocks_and_its_load_is_cancelled():
    """Aborted while its KV is on its way: its blocks stay held until the load ended (no
    write lands in a reused block), and the worker hears to stop it, once."""
    conn = connector()
    req = decode_request()
    allocate(conn, req)
    step(conn)
    assert finish(conn, req, RequestStatus.FINISHED_ABORTED) == (True, None)
    assert step(conn).cancelled == ["req-1"]
    assert step(conn).cancelled == []


def test_a_request_finished_after_its_load_ended_frees_its_blocks():
    conn = connector()
    req = decode_request()
    allocate(conn, req)
    step(conn)
    conn.update_connector_output(KVConnectorOutput(finished_recving={"req-1"}))
    assert finish(conn, req, RequestStatus.FINISHED_STOPPED) == (False, None)
    assert step(conn).cancelled == []


def test_a_finished_sync_load_frees_its_blocks_at_once():
    """A sync load ends within the step that scheduled it."""
    conn = connector(load_mode="sync")
    req = decode_request()
    allocate(conn, req)
    step(conn)
    assert finish(conn, req, RequestStatus.FINISHED_ABORTED) == (False, None)


def test_a_finished_requests_id_is_forgotten():
    """Nothing of a finished request stays in the books: a new request under its id (an
    engine that numbers its requests anew) is matched for its own prompt."""
    conn = connector()
    req = decode_request()
    allocate(conn, req)
    step(conn)
    conn.update_connector_output(KVConnectorOutput(finished_recving={"req-1"}))
    finish(conn, req, RequestStatus.FINISHED_STOPPED)
    assert conn.get_num_new_matched_tokens(decode_request(), CACHED) == (68, True)


def test_an_unknown_request_in_the_workers_output_changes_nothing():
    """finished_recving / finished_sending of an id the scheduler side does not know (a
    request of the other role, one ended already) are harmless; a load still on its way
    stays so."""
    conn = connector()
    req = decode_request()
    allocate(conn, req)
    step(conn)
    conn.update_connector_output(
        KVConnectorOutput(finished_recving={"nobody"}, finished_sending={"req-1", "nobody"})
    )
    assert finish(conn, req, RequestStatus.FINISHED_ABORTED) == (True, None)


# ---- prefill side: what each step stores ------------------------------------------------


def test_a_prefill_step_stores_the_scheduled_prompt_tokens_into_their_blocks():
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    meta = step(conn, new_step(prefill_request(), [1, 2], 64))
    assert meta.stores == [
        {
            "req": "req-1",
            "tid": "t-req-1",
            "blocks": [1, 2],
            "start": 0,
            "end": 64,
            "prompt_len": 100,
        }
    ]


def test_a_chunked_prompt_is_stored_step_by_step_with_the_blocks_allocated_so_far():
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    step(conn, new_step(prefill_request(), [1, 2], 64))
    stores = step(conn, cached_step("req-1", 64, 36, new_blocks=[3, 4])).stores
    assert [(s["blocks"], s["start"], s["end"]) for s in stores] == [([1, 2, 3, 4], 64, 100)]


def test_a_step_past_the_prompt_stores_nothing():
    """Only prompt tokens go to the decode side."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    step(conn, new_step(prefill_request(), [1, 2, 3, 4], 100))
    assert step(conn, cached_step("req-1", 100, 1)).stores == []


def test_a_resumed_request_stores_into_its_new_blocks():
    """Preempted, its blocks were freed; resumed, it has new ones, all of them."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    step(conn, new_step(prefill_request(), [1, 2], 64))
    stores = step(conn, cached_step("req-1", 0, 100, new_blocks=[5, 6, 7, 8], resumed=True)).stores
    assert [(s["blocks"], s["start"], s["end"]) for s in stores] == [([5, 6, 7, 8], 0, 100)]


def test_a_steps_stores_are_not_changed_by_a_later_step():
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    first = step(conn, new_step(prefill_request(), [1, 2], 64))
    step(conn, cached_step("req-1", 64, 36, new_blocks=[3, 4]))
    assert first.stores[0]["blocks"] == [1, 2]


def test_a_request_without_do_remote_decode_is_not_stored_nor_held():
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    req = request("req-1", {TRANSFER_ID: "t-1"})
    assert step(conn, new_step(req, [1, 2, 3, 4], 100)).stores == []
    assert finish(conn, req, RequestStatus.FINISHED_LENGTH_CAPPED) == (False, None)


@pytest.mark.parametrize("tid", [7, None, ["t"], ""], ids=["int", "none", "list", "empty"])
def test_a_remote_decode_with_a_bad_transfer_id_is_stored_nowhere_naming_why(tid, caplog):
    """Refused alone (never an exception into vLLM's scheduler): a warning naming the
    request and the key; the step stores nothing of it, and it holds no block when done;
    the other requests of the step are stored."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    bad, good = prefill_request("req-9", **{TRANSFER_ID: tid}), prefill_request("req-1")
    out = new_step(bad, [1, 2, 3, 4], 100)
    other = new_step(good, [5, 6, 7, 8], 100)
    out.scheduled_new_reqs += other.scheduled_new_reqs
    out.num_scheduled_tokens.update(other.num_scheduled_tokens)
    with caplog.at_level(logging.WARNING, logger="pdhal_vllm"):
        stores = step(conn, out).stores
    assert re.search(rf"request req-9.*{TRANSFER_ID}.*no decode side", caplog.text)
    assert [s["req"] for s in stores] == ["req-1"]
    assert finish(conn, bad, RequestStatus.FINISHED_LENGTH_CAPPED) == (False, None)


# ---- prefill side: a request that finishes ----------------------------------------------


def test_a_finished_prefill_request_holds_its_blocks_and_names_its_transfer():
    """Its blocks stay until the messager wrote them (the worker's finished_sending); its
    kv_transfer_params are the decode side's to be asked with (the client's transfer id,
    this instance's messager); nothing is abandoned."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    req = prefill_request()
    step(conn, new_step(req, [1, 2, 3, 4], 100))
    assert finish(conn, req, RequestStatus.FINISHED_LENGTH_CAPPED) == (
        True,
        {"do_remote_prefill": True, TRANSFER_ID: "t-req-1", MESSAGER: PREFILL_MESSAGER},
    )
    assert step(conn).abandoned == []


def test_a_prefill_request_given_no_transfer_id_is_stored_under_one_it_names():
    """vLLM's proxy pattern: the prefill is asked with do_remote_decode alone, and what its
    answer carries is passed on to the decode side, which a decode instance takes."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    req = prefill_request("req-7", **{TRANSFER_ID: DROP})
    assert [s["tid"] for s in step(conn, new_step(req, [1, 2, 3, 4], 100)).stores] == [
        "pdhal-req-7"
    ]
    _, params = finish(conn, req, RequestStatus.FINISHED_LENGTH_CAPPED)
    decode = connector()
    assert allocate(decode, request("req-8", params), 0) == len(PROMPT)
    assert [(x["tid"], x["messager"]) for x in step(decode).loads] == [
        ("pdhal-req-7", PREFILL_MESSAGER)
    ]


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_an_aborted_or_failed_prefill_request_is_abandoned_to_the_worker_once(status):
    """Nobody will decode it: its transfer fails at once (the next step's metadata says
    so), and its blocks stay held until the worker reports that end."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    req = prefill_request()
    step(conn, new_step(req, [1, 2], 64))
    held, _ = finish(conn, req, status)
    assert held
    assert step(conn).abandoned == ["t-req-1"]
    assert step(conn).abandoned == []


def test_a_prefill_request_aborted_before_any_step_stored_it_holds_nothing():
    """Aborted while waiting: no block was written, no transfer to abandon."""
    conn = connector("kv_producer", messager=PREFILL_MESSAGER)
    assert finish(conn, prefill_request(), RequestStatus.FINISHED_ABORTED) == (False, None)
    assert step(conn).abandoned == []


# ---- kv_transfer_params from outside: refused where they come in ------------------------


@pytest.mark.parametrize("tid", [7, None, ["t"], ""], ids=["int", "none", "list", "empty"])
def test_a_transfer_id_that_is_not_a_string_is_refused_when_matched(tid, caplog):
    computed_here(
        connector(), decode_request(**{TRANSFER_ID: tid}), caplog, f"{TRANSFER_ID}.*computed here"
    )


@pytest.mark.parametrize(
    "messager",
    [47100, "127.0.0.1", {"host": "127.0.0.1"}, ":5000", "h:99999"],
    ids=["int", "no-port", "object", "no-host", "port-range"],
)
def test_a_messager_that_is_not_host_port_is_refused_when_matched(messager, caplog):
    computed_here(connector(), decode_request(**{MESSAGER: messager}), caplog, MESSAGER)
