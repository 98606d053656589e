"""The cache messager: waits on pdhal progress and ships each finished layer to decode.

Its main thread never sleeps in a loop: every wake-up comes from the worker's layer signal
(a futex wait in pdhal), and it sends exactly the blocks that signal made ready. With
Mooncake it only submits them; a completion thread waits for each layer's transfers (Mooncake
offers no wait that does not spin a core, so that thread sleeps between status checks, and
only while transfers are in flight).
"""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np

import pdhal
from pdhal import ops
from pdhal_demo.control import DemoError, Outbox
from pdhal_demo.plan import Plan
from pdhal_demo.transport import MooncakeSender, ShmSender, block_runs

WAIT_TIMEOUT_S = 60.0  # a worker that signals nothing for this long is reported, not waited on


class Shipper:
    """Tracks what has been sent and reports each transfer to the parent.

    A sender's `write` either moves the bytes before it returns (shm: it returns None) or
    submits them and returns a handle (Mooncake): then up to `inflight` layers are in
    flight at once and a completion thread waits for each, in order, reports it, and
    reports a request fully sent once its last layer's transfer is complete.
    """

    def __init__(self, link, plan: Plan, sender, rank: int = 0, inflight: int = 4):
        self.out, self.plan, self.sender, self.rank = Outbox(link), plan, sender, rank
        self.bs = plan.model.block_size
        self.sent_blocks = {
            (r.id, layer): 0 for r in plan.requests for layer in range(plan.model.layers)
        }
        self.unsubmitted = {r.id for r in plan.requests}  # whose last transfer is not submitted
        self.unfinished = {r.id for r in plan.requests}  # not yet reported fully sent
        self.block_bytes = plan.model.block_bytes(plan.tp)
        self._runs: dict[tuple, tuple[list, int]] = {}  # spans -> (runs, blocks)
        self.link = link
        self.released: set[int] = set()  # requests the decode side is done with
        self.started: set[int] = set()  # requests whose first block was written
        if hasattr(sender, "wait"):
            self._slots = threading.BoundedSemaphore(inflight)
            self._inflight: queue.Queue = queue.Queue()
            threading.Thread(
                target=self._complete, name="pdhal-demo-completion", daemon=True
            ).start()

    def send(self, step: int, index: int, layer: int, ready: list[tuple[int, int]]) -> None:
        """Send layer `layer` of each (request, tokens now in the cache) in `ready`: channel
        step `step`, the plan's step `index` (the parent's progress lines go by it)."""
        for request_id, _ in ready:
            if request_id not in self.started:  # its decode blocks may still be in use
                self._await_released(self.plan.requests[request_id])
        start = time.monotonic_ns()
        spans, finished = [], []
        last_layer = layer == self.plan.model.layers - 1
        for request_id, tokens in ready:
            request = self.plan.requests[request_id]
            whole = tokens == request.prompt_len
            end = -(-tokens // self.bs) if whole else tokens // self.bs
            first = self.sent_blocks[request_id, layer]
            if end > first:
                spans.append((request_id, first, end))
                self.sent_blocks[request_id, layer] = end
            if whole and last_layer:
                finished.append(request_id)
                self.unsubmitted.discard(request_id)
        # Every layer of a step sends the same spans: pair the tables into runs once.
        key = tuple(spans)
        planned = self._runs.get(key)
        if planned is None:
            src, dst = [], []
            for request_id, first, end in spans:
                request = self.plan.requests[request_id]
                src += request.prefill_blocks[first:end]
                dst += request.decode_blocks[first:end]
            # runs span requests where both tables are consecutive: fewer, longer copies
            planned = self._runs[key] = (block_runs(src, dst), len(src))
        runs, blocks = planned
        event = {
            "rank": self.rank,
            "step": step,
            "index": index,
            "layer": layer,
            "start": start,
            "bytes": 2 * blocks * self.block_bytes,
        }
        if hasattr(self, "_inflight"):  # in order behind the layers still in flight
            self._slots.acquire()  # at most `inflight` layers in flight
            self._inflight.put((event, self.sender.write(layer, runs) if runs else None, finished))
            return
        if runs:
            self.sender.write(layer, runs)
        self._done(event, finished)

    def _await_released(self, request) -> None:
        """Before a request's first block: the decode side must be done with the requests
        whose decode blocks it reuses (the parent relays each release)."""
        self.started.add(request.id)
        if self.released.issuperset(request.decode_waits):
            return
        self.out.flush()
        while not self.released.issuperset(request.decode_waits):
            if not self.link.poll(WAIT_TIMEOUT_S):
                raise DemoError(
                    f"the decode side released none of {request.decode_waits} "
                    f"within {WAIT_TIMEOUT_S:.0f} s"
                )
            kind, message = self.link.recv()
            if kind == "exit":
                raise DemoError(
                    "the run failed elsewhere while the messager waited for "
                    "decode blocks to come free"
                )
            self.released.add(message["request"])  # ("released", ...)

    def _done(self, event: dict, finished: list[int]) -> None:
        event["end"] = time.monotonic_ns()
        self.out.post("xfer", event)
        for request_id in finished:
            self.unfinished.discard(request_id)
            self.out.send("sent", {"rank": self.rank, "request": request_id})

    def _complete(self) -> None:
        """The completion thread: each submitted layer, in order, once it is in decode."""
        while True:
            event, pending, finished = self._inflight.get()
            try:
                if pending is not None:
                    self.sender.wait(pending)
            except Exception as exc:  # nothing after a failed transfer can be trusted
                error = str(exc) if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"
                self.out.send("error", {"role": "messager", "error": error, "detail": error})
                os._exit(1)  # Mooncake's threads may be stuck on the dead link: no unwinding
            self._done(event, finished)
            self._slots.release()
            self._inflight.task_done()
            self.out.due()

    def drain(self) -> None:
        """Wait until every submitted transfer is complete and reported."""
        if hasattr(self, "_inflight"):
            self._inflight.join()
        self.out.flush()

    def idle(self) -> None:
        """About to block for the worker's next signal: let the parent have what is queued."""
        self.out.flush()


def _per_query(shipper: Shipper, plan: Plan, reader, base: int) -> None:
    """Progress is one (step, layer) word: send every layer up to it, older steps whole.

    `base` is the worker's warm-up step, so plan step i is channel step base + 1 + i.
    """
    layers = plan.model.layers
    with reader:
        seen = (base, -1)
        index, done = 0, -1  # the first step not wholly sent, and its last layer sent
        while shipper.unsubmitted:
            shipper.idle()  # before blocking: the parent wakes while this one sleeps
            seen = reader.wait(seen, timeout=WAIT_TIMEOUT_S)
            while index < len(plan.steps) and base + 1 + index <= seen[0]:
                channel_step = base + 1 + index
                upto = seen[1] if channel_step == seen[0] else layers - 1
                ready = [(c.request, c.start + c.length) for c in plan.steps[index]]
                for layer in range(done + 1, upto + 1):
                    shipper.send(channel_step, index, layer, ready)
                done = max(done, upto)
                if done < layers - 1:
                    break
                index, done = index + 1, -1


def _per_chunk(shipper: Shipper, plan: Plan, rank: int, device: int) -> None:
    """Each (step, layer) record lists (slot, cached, chunk) of the requests it advanced; the
    plan says which request held each batch slot in that step (slots are reused)."""
    record = np.zeros(pdhal.RECORD_WORDS, np.int32)
    first = None  # the channel step of plan step 0: the ring hands over every step in order
    with ops.open_kv_chunk_reader(rank, device, timeout=WAIT_TIMEOUT_S) as reader:
        while shipper.unsubmitted:
            shipper.idle()  # before blocking: the parent wakes while this one sleeps
            step = reader.next(record, wait=True, timeout=WAIT_TIMEOUT_S)
            first = step if first is None else first
            holder = {plan.request(c.request).slot: c.request for c in plan.steps[step - first]}
            count, layer = int(record[0]), int(record[1])
            table = record[2 : 2 + 3 * count].reshape(count, 3)
            shipper.send(
                step,
                step - first,
                layer,
                [(holder[int(slot)], int(cached + length)) for slot, cached, length in table],
            )


def run(link, setup: dict) -> None:
    """One rank's messager. It sees every device (FastDeploy's cache processes do) and
    names its rank's channels by the rank and the device id the parent gives it."""
    plan = Plan.from_json(setup["plan"])
    rank, device = setup["rank"], setup["device"]
    src_shape = plan.model.cache_shape(plan.prefill_cache_blocks, plan.tp)
    dst_shape = (plan.tp, *plan.model.cache_shape(plan.decode_cache_blocks, plan.tp))
    src = ops.share_external_data(np.empty(0, np.float32), setup["prefill_cache"], src_shape)
    if plan.transport == "shm":
        sender = ShmSender(src, setup["decode"], dst_shape, setup.get("shm_copy", "memmove"), rank)
    else:
        sender = MooncakeSender(
            src,
            setup["decode"],
            dst_shape,
            setup["host"],
            setup["protocol"],
            setup.get("transfer_timeout_s", 5.0),
            rank,
        )
    if setup.get("slow_ms"):
        sender = Slowed(sender, setup["slow_ms"] / 1e3)
    if plan.mode == "per_query":
        # Before "ready", so the worker (which starts only after both are ready) has not
        # begun its first step. The channel exists before the warm-up step is published in
        # it, so wait for that step rather than read what is there: (0, -1) would shift
        # every step by one.
        reader = ops.open_kv_signal_reader(rank, device, timeout=WAIT_TIMEOUT_S)
        base, _ = reader.wait((0, -1), timeout=WAIT_TIMEOUT_S)
    link.send(("ready", {"pid": os.getpid()}))
    shipper = Shipper(link, plan, sender, rank, setup.get("inflight", 4))
    if plan.mode == "per_query":
        _per_query(shipper, plan, reader, base)
    else:  # the ring hands over every step from the first, whenever the reader attaches
        _per_chunk(shipper, plan, rank, device)
    shipper.drain()
    shipper.out.send("done", {})
    while link.recv()[0] != "exit":  # stay alive until then: the worker takes an exit for a
        pass  # death (what comes before it are the last releases)


class Slowed:
    """A slow link (--slow-rank): every layer's write waits `delay_s` first, in line."""

    def __init__(self, sender, delay_s: float):
        self._sender, self._delay = sender, delay_s
        if hasattr(sender, "wait"):
            self.wait = sender.wait

    def write(self, layer: int, runs):
        time.sleep(self._delay)
        return self._sender.write(layer, runs)
