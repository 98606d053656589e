"""The cache messager: configuration around pdhal.transfer's PrefillService.

Its main thread never sleeps in a loop: every wake-up comes from the worker's layer signal
(a futex wait in pdhal), which it hands to the service as "this layer now holds these
tokens of these requests" (a PerQueryFeed or a PerChunkFeed turns each mode's words into
that). The decoder claims each request from the service, into blocks it has free (pdhal's
session: no relaying through the parent); the service's streamer sends the blocks that
became ready, up to --inflight layers in flight, and ends each request exactly once; its
outcome comes back on the service's thread (on_outcome), which tells the parent (a landed
request's prefill blocks are free) or, on a failure, reports it and exits. The timeline's
transfers are the streamer's own per-layer records, a request's first submit and landing
its per-request record.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

import pdhal
from pdhal import ops, transfer
from pdhal_demo.control import DemoError, Outbox, configure_transport
from pdhal_demo.model import cache_layout
from pdhal_demo.plan import Plan

WAIT_TIMEOUT_S = 60.0  # a worker that signals nothing for this long is reported, not waited on
CLAIM_TIMEOUT_S = 600.0  # a request whose decode blocks never come free fails after this
#: The control session's liveness bound: a decoder silent this long has gone.
KEEPALIVE_S = 5.0


class Messager:
    """One rank's prefill service, and the events the parent's report is made of."""

    def __init__(self, link, plan: Plan, setup: dict, cache: np.ndarray):
        self.link, self.out, self.plan, self.rank = link, Outbox(link), plan, setup["rank"]
        self.service = transfer.PrefillService(
            cache_layout(cache),
            plan.model.block_size,
            key=bytes.fromhex(setup["session_key"]),
            tp_rank=self.rank,
            tp_size=plan.tp,
            listen=f"{setup['host']}:0",
            keepalive=KEEPALIVE_S,
            claim_timeout=CLAIM_TIMEOUT_S,
            transport_name=plan.transport,
            on_outcome=self._ended,
            max_layers_in_flight=setup.get("inflight", 4),
            stall_timeout=setup.get("transfer_timeout_s", 5.0),
        )
        self.streamer = self.service.streamer  # its metrics make the timeline
        self.delay_s = setup.get("slow_ms", 0) / 1e3
        self.added: set[int] = set()  # requests given to the service
        self.landed: set[int] = set()
        self.all_landed = threading.Event()
        self.offset = 0  # the channel step of plan step 0
        self._mark, self._request_mark, self._report = 0, 0, threading.Lock()

    def prepare(self, index: int) -> None:
        """Before plan step `index`'s first layer: its requests that start here are added
        (each goes to its decode blocks once the decoder claims it)."""
        for chunk in self.plan.steps[index]:
            request = self.plan.request(chunk.request)
            if request.id not in self.added:
                self.added.add(request.id)
                self.service.add_request(
                    str(request.id), request.prefill_blocks, request.prompt_len
                )

    def layer_ready(self, layer: int, ready, signal_ns: int | None = None, *, step=None):
        """The service's layer_ready, after --slow-rank's delay (a slow link: each layer's
        transfer waits, in line)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        self.service.layer_ready(layer, ready, signal_ns, step=step)

    @property
    def layout(self):  # what a feed reads of what it drives
        return self.service.layout

    def _ended(self, outcome: transfer.Outcome) -> None:
        """on_outcome: a landed request is told to the parent at once (its prefill blocks
        are free, its decode side may have it); a failure ends the run."""
        self.report()
        if not outcome.landed:
            error = f"request {outcome.request_id} failed: {outcome.reason}"
            self.out.send("error", {"role": "messager", "error": error, "detail": error})
            os._exit(1)  # a transport's threads may be stuck on the dead link: no unwinding
        request = int(outcome.request_id)
        self.landed.add(request)
        self.out.send("sent", {"rank": self.rank, "request": request})
        if len(self.landed) == len(self.plan.requests):
            self.all_landed.set()

    def report(self) -> None:
        """Post the streamer's layer records made since the last report as "xfer" events,
        its records of the requests that landed since as "landed" events."""
        with self._report:
            ended, self._request_mark = self.streamer.metrics.requests_since(self._request_mark)
            for r in ended:
                if r.landed:
                    self.out.post(
                        "landed",
                        {
                            "rank": self.rank,
                            "request": int(transfer.request_of(r.request_id)),  # (its part)
                            "first_submit": r.first_submit_ns,
                            "end": r.end_ns,
                        },
                    )
            records, self._mark = self.streamer.metrics.layers_since(self._mark)
            for r in records:
                if r.landed:
                    self.out.post(
                        "xfer",
                        {
                            "rank": self.rank,
                            "step": r.step,
                            "index": r.step - self.offset,
                            "layer": r.layer,
                            "start": r.submit_ns,
                            "end": r.end_ns,
                            "bytes": r.nbytes,
                        },
                    )
        self.out.due()

    def idle(self) -> None:
        """About to block for the worker's next signal: let the parent have what is queued."""
        self.report()
        self.out.flush()

    def drain(self) -> None:
        """Wait until every request landed (a failure exits before)."""
        self.idle()
        if not self.all_landed.wait(WAIT_TIMEOUT_S):
            raise DemoError(
                f"{len(self.plan.requests) - len(self.landed)} requests had not landed "
                f"{WAIT_TIMEOUT_S:.0f} s after their last layer was signalled"
            )
        self.idle()


def _per_query(messager: Messager, plan: Plan, reader, base: int) -> None:
    """Progress is one (step, layer) word; plan step i is channel step base + 1 + i (`base`
    is the worker's warm-up step)."""
    feed = transfer.PerQueryFeed(messager)
    messager.offset = base + 1
    last = (base + len(plan.steps), plan.model.layers - 1)
    seen, given = (base, -1), 0  # given: plan steps whose table the feed has
    with reader:
        while seen < last:
            messager.idle()  # before blocking: the parent wakes while this one sleeps
            seen = reader.wait(seen, timeout=WAIT_TIMEOUT_S)
            signal_ns = time.monotonic_ns()
            while given < len(plan.steps) and base + 1 + given <= seen[0]:
                # the steps before it go whole first: the requests whose decode blocks this
                # step's new requests reuse may be among them
                feed.progress((base + given, plan.model.layers - 1), signal_ns)
                messager.prepare(given)
                table = [(str(c.request), c.start + c.length) for c in plan.steps[given]]
                feed.step(base + 1 + given, table)
                given += 1
            feed.progress(seen, signal_ns)


def _per_query_followed(messager: Messager, plan: Plan, reader, base: int) -> None:
    """--follow: each plan step goes to the service once, as the worker begins it (its
    table in hand), and each of its layers' copies starts on the link at the layer's
    signal: this thread wakes once per step, not per layer."""
    messager.offset = base + 1
    last = base + len(plan.steps)
    seen, given = (base, -1), 0
    with reader:
        while seen[0] < last or given < len(plan.steps):
            messager.idle()  # before blocking: the parent wakes while this one sleeps
            seen = reader.wait(seen, timeout=WAIT_TIMEOUT_S)
            while given < len(plan.steps) and base + 1 + given <= seen[0]:
                messager.prepare(given)
                table = [(str(c.request), c.start + c.length) for c in plan.steps[given]]
                messager.service.follow(reader, base + 1 + given, table)
                given += 1
            seen = (seen[0], plan.model.layers - 1)  # wake at the next step's beginning


def _per_chunk(messager: Messager, plan: Plan, rank: int, device: int) -> None:
    """Each (step, layer) record lists (slot, cached, chunk) of the requests it advanced; the
    plan says which request held each batch slot in that step (slots are reused)."""
    feed = transfer.PerChunkFeed(messager)
    record = np.zeros(pdhal.RECORD_WORDS, np.int32)
    first = None  # the channel step of plan step 0: the ring hands over every step in order
    layers, given = plan.model.layers, set()
    with ops.open_kv_chunk_reader(rank, device, timeout=WAIT_TIMEOUT_S) as reader:
        while True:
            messager.idle()  # before blocking: the parent wakes while this one sleeps
            step = reader.next(record, wait=True, timeout=WAIT_TIMEOUT_S)
            signal_ns = time.monotonic_ns()
            if first is None:
                first = messager.offset = step
            index = step - first
            if index not in given:
                given.add(index)
                messager.prepare(index)
                feed.slots(
                    step, {plan.request(c.request).slot: str(c.request) for c in plan.steps[index]}
                )
            feed.record(step, record, signal_ns)
            if index == len(plan.steps) - 1 and int(record[1]) == layers - 1:
                return


def run(link, setup: dict) -> None:
    """One rank's messager. It sees every device (FastDeploy's cache processes do) and
    names its rank's channels by the rank and the device id the parent gives it."""
    plan = Plan.from_json(setup["plan"])
    rank, device = setup["rank"], setup["device"]
    configure_transport(plan.transport, setup["host"], setup["protocol"])
    src_shape = plan.model.cache_shape(plan.prefill_cache_blocks, plan.tp)
    cache = ops.share_external_data(np.empty(0, np.float32), setup["prefill_cache"], src_shape)
    messager = Messager(link, plan, setup, cache)
    address = messager.service.address
    if plan.mode == "per_query":
        # Before "ready", so the worker (which starts only after both are ready) has not
        # begun its first step. The channel exists before the warm-up step is published in
        # it, so wait for that step rather than read what is there: (0, -1) would shift
        # every step by one.
        reader = ops.open_kv_signal_reader(rank, device, timeout=WAIT_TIMEOUT_S)
        base, _ = reader.wait((0, -1), timeout=WAIT_TIMEOUT_S)
    link.send(("ready", {"pid": os.getpid(), "address": address}))
    try:
        if plan.mode == "per_query":
            follow = _per_query_followed if setup.get("follow") else _per_query
            follow(messager, plan, reader, base)
        else:  # the ring hands over every step from the first, whenever the reader attaches
            _per_chunk(messager, plan, rank, device)
    except pdhal.ProducerDiedError as e:  # the decode side hears it too, not by its deadline
        messager.service.abort(f"the prefill worker died ({type(e).__name__}: {e})")
        raise
    messager.drain()
    messager.out.send("done", {})
    while link.recv()[0] != "exit":  # stay alive until then: the worker takes an exit for a
        pass  # death
    messager.service.close()
