"""The prefill side of layer-wise transfers: as each layer's signal arrives, the blocks it
made ready, of every request whose destination is known, go to the decode side while the
next layers compute.

layer_ready(layer, [(request, tokens in the cache)]) is the whole interface to the signals
(a per-query step's requests, or a per-chunk record's): a request's full blocks go as its
chunks fill them, its last partial block once the prompt is whole. Runs consecutive on both
sides are planned once per set of block pairs and reused for every layer. Up to
max_layers_in_flight submits are in flight; a completion thread waits for them in order, and
a request has landed once every layer of its prompt has, which its decode side then reads
in its status slot. A failure ends the requests it touches, on both sides, and nothing else."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from dataclasses import dataclass, field

from pdhal._errors import InvalidArgumentError, TransferError
from pdhal._transfer import mailbox
from pdhal._transfer.contract import Batch, Link
from pdhal._transfer.layout import CacheLayout, RunPlanner, block_runs
from pdhal._transfer.metrics import LayerRecord, TransferMetrics
from pdhal._transfer.outcome import Outcome
from pdhal._transfer.plugins import transport

#: How often layer_ready looks for expired leases and dead peers (poll() always does).
CHECK_S = 0.05


class Destination:
    """One decode side this streamer sends to (from connect(describe())): its link, its
    runs, and its own window of submits in flight with the thread that completes them in
    order, so a stalled decode side holds up only its own transfers."""

    def __init__(self, link: Link, planner: RunPlanner, status_region: int, window: int):
        self.link, self.planner, self.status_region = link, planner, status_region
        self.slots = threading.BoundedSemaphore(window)
        self.queue: queue.Queue[_Submit | None] = queue.Queue()
        self.outstanding = 0  # submits queued for its completion thread, or being waited
        self.thread: threading.Thread | None = None


@dataclass
class _Request:
    id: str
    src_blocks: list[int]
    prompt_tokens: int
    added: float
    layers: int
    cached: int = 0  # the prompt's first blocks, on the decode side already
    dest: Destination | None = None
    dst_blocks: list[int] = field(default_factory=list)
    ticket: dict | None = None
    ready: list[int] = field(default_factory=list)  # tokens in the cache, per layer
    sent: list[int] = field(default_factory=list)  # blocks submitted, per layer
    unsent_layers: int = 0  # layers not all of whose blocks were submitted
    in_flight: int = 0  # submits carrying it not yet landed
    ended: bool = False
    nbytes: int = 0
    first_submit_ns: int | None = None
    last_signal_ns: int | None = None

    def __post_init__(self):
        self.ready, self.sent = [0] * self.layers, [0] * self.layers
        self.blocks = len(self.src_blocks)
        self.unsent_layers = self.layers

    def sendable(self, layer: int, block_tokens: int) -> int:
        """Blocks of `layer` that may go: the full ones, the last partial one once whole."""
        tokens = self.ready[layer]
        if tokens >= self.prompt_tokens:
            return self.blocks
        return min(max(tokens // block_tokens - self.cached, 0), self.blocks)

    def mark_sent(self, layer: int, blocks: int) -> None:
        self.sent[layer] = blocks
        if blocks == self.blocks:
            self.unsent_layers -= 1


@dataclass
class _Submit:
    batch: Batch
    dest: Destination
    layer: int
    items: list  # (request, blocks) it carries
    nbytes: int
    signal_ns: int
    submit_ns: int


class KVStreamer:
    """Streams the KV blocks of requests in `layout` (the prefill caches) to the decode
    sides they are assigned to, layer by layer."""

    def __init__(
        self,
        layout: CacheLayout,
        block_tokens: int,
        *,
        transport_name: str = "shm",
        max_layers_in_flight: int = 4,
        stall_timeout: float = 10.0,
        claim_timeout: float = 60.0,
    ):
        for what, value in (
            ("block_tokens", block_tokens),
            ("max_layers_in_flight", max_layers_in_flight),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{what} must be an int >= 1, got {value!r}")
        for what, value in (("stall_timeout", stall_timeout), ("claim_timeout", claim_timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgumentError(f"{what} must be seconds > 0, got {value!r}")
        self.layout, self.block_tokens = layout, block_tokens
        self.stall_timeout, self.claim_timeout = float(stall_timeout), float(claim_timeout)
        self._transport = transport(transport_name)
        self._lock = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._outcomes: list[Outcome] = []
        self._plans: dict[tuple, list] = {}  # block pairs -> their runs (cleared per step)
        self._destinations: dict[object, Destination] = {}
        self._window = max_layers_in_flight
        # status words go out from here (registered with each link as a source)
        self._scratch = (ctypes.c_char * mailbox.SLOT_BYTES)()
        self._scratch_address = ctypes.addressof(self._scratch)
        self._scratch_lock = threading.Lock()
        self.metrics = TransferMetrics()
        self._next_check = 0.0
        self._closed = False

    # ---- destinations and requests --------------------------------------------------

    def connect(self, described: dict) -> Destination:
        """The decode side `described` (a KVReceiver's describe()), connected once: its
        layout is checked to pair with this one cache by cache."""
        key = (described.get("transport"), repr(sorted(described.items())))
        with self._lock:
            stale = self._destinations.pop(key, None)
            if stale is not None and stale.link.problem() is None:
                self._destinations[key] = stale
                return stale
        if stale is not None:
            self._retire(stale)  # its requests fail by its problem; new ones get a new link
        layers = self.layout.check_peer(described["layout"])
        link = self._transport.connect(
            described, [*self.layout.regions, (self._scratch_address, len(self._scratch))]
        )
        planner = RunPlanner(self.layout, layers)
        dest = Destination(link, planner, int(described["status_region"]), self._window)
        dest.thread = threading.Thread(
            target=self._complete, args=(dest,), name="pdhal-transfer-completion", daemon=True
        )
        dest.thread.start()
        with self._lock:
            self._destinations[key] = dest
        return dest

    def add_request(
        self, request_id: str, src_blocks, prompt_tokens: int, cached_blocks: int = 0
    ) -> None:
        """A request whose KV is (or will be) in `src_blocks` of the prefill caches, its
        prompt `prompt_tokens` long; failed if no destination is set within claim_timeout.
        `cached_blocks`: the prompt's first blocks, which the decode side has already (a
        prefix it cached): not sent, and not in `src_blocks`."""
        src = list(src_blocks)
        whole = -(-prompt_tokens // self.block_tokens) if isinstance(prompt_tokens, int) else -1
        cached = cached_blocks if isinstance(cached_blocks, int) else -1
        need = whole - cached
        if isinstance(prompt_tokens, bool) or whole < 1 or not 0 <= cached < whole:
            raise InvalidArgumentError(
                f"request {request_id!r}: a prompt of {prompt_tokens!r} tokens in blocks of "
                f"{self.block_tokens}, {cached_blocks!r} of them cached, sends nothing"
            )
        if len(src) != need:
            raise InvalidArgumentError(
                f"request {request_id!r}: a prompt of {prompt_tokens!r} tokens in blocks of "
                f"{self.block_tokens} ({cached} cached) needs {need} blocks, got {len(src)}"
            )
        block_runs(src, src)  # checks the ids
        with self._lock:
            if request_id in self._requests:
                raise InvalidArgumentError(f"request {request_id!r} was added already")
            self._requests[request_id] = _Request(
                request_id, src, prompt_tokens, time.monotonic(), self.layout.num_layers, cached
            )

    def set_destination(self, request_id: str, dest: Destination, dst_blocks, ticket) -> None:
        """Where `request_id` goes: blocks `dst_blocks` of `dest`'s caches, its outcome to
        the status slot of `ticket` (the decode side's expect()). The layers ready already
        go at once."""
        dst = list(dst_blocks)
        with self._lock:
            request = self._live(request_id)
            if request.dest is not None:
                raise InvalidArgumentError(f"request {request_id!r} has a destination already")
            block_runs(request.src_blocks, dst)  # checks they pair up
            request.dest, request.dst_blocks, request.ticket = dest, dst, dict(ticket)
            items = [
                (request, layer)
                for layer in range(request.layers)
                if request.sendable(layer, self.block_tokens) > request.sent[layer]
            ]
        for layer in sorted({layer for _, layer in items}):
            self._send(dest, layer, [request], time.monotonic_ns())
        self._finish_if_done(request)

    def _live(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidArgumentError(f"request {request_id!r} is unknown (or ended)")
        return request

    # ---- the signals --------------------------------------------------------------

    def layer_ready(self, layer: int, ready, signal_ns: int | None = None) -> None:
        """Layer `layer` now holds `tokens` of each (request_id, tokens) in `ready`: send
        what became ready. `signal_ns`: when the signal was seen (time.monotonic_ns())."""
        signal_ns = time.monotonic_ns() if signal_ns is None else signal_ns
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise InvalidArgumentError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgumentError(
                f"layer {layer} is outside the layout's {self.layout.num_layers} layers"
            )
        by_dest: dict[int, tuple[Destination, list[_Request]]] = {}
        if time.monotonic() >= self._next_check:  # leases and peers, every CHECK_S at most
            with self._lock:
                expired = self._expired()
            for request_id, why in expired:
                self.fail(request_id, why)
        with self._lock:
            for request_id, tokens in ready:
                request = self._requests.get(request_id)
                if request is None or request.ended:
                    continue  # ended (failed) already: its later layers go nowhere
                request.ready[layer] = max(request.ready[layer], int(tokens))
                if layer == request.layers - 1 and tokens >= request.prompt_tokens:
                    request.last_signal_ns = signal_ns
                if request.dest is None:
                    continue
                if request.sendable(layer, self.block_tokens) > request.sent[layer]:
                    by_dest.setdefault(id(request.dest), (request.dest, []))[1].append(request)
        for dest, requests in by_dest.values():
            self._send(dest, layer, requests, signal_ns)

    def _send(self, dest: Destination, layer: int, requests: list[_Request], signal_ns: int):
        """Submit the newly sendable blocks of `requests` in `layer` to `dest`."""
        with self._lock:
            spans, items = [], []
            for request in requests:
                first, end = request.sent[layer], request.sendable(layer, self.block_tokens)
                if end <= first or request.ended:
                    continue
                spans.append((request, first, end))
                items.append((request, end - first))
                request.mark_sent(layer, end)
                request.in_flight += 1
            if not items:
                return
            key = (id(dest), tuple((r.id, first, end) for r, first, end in spans))
            runs = self._plans.get(key)  # every layer of a step sends the same spans
        blocks = sum(n for _, n in items)
        if runs is None:
            src, dst = [], []
            for request, first, end in spans:
                src += request.src_blocks[first:end]
                dst += request.dst_blocks[first:end]
            try:
                runs = block_runs(src, dst)
                dest.planner.check(runs)
            except InvalidArgumentError as e:
                self._fail_items(items, str(e))
                return
            with self._lock:
                if len(self._plans) > 1024:
                    self._plans.clear()
                self._plans[key] = runs
        copies = dest.planner.copies(layer, runs)
        nbytes = dest.planner.block_bytes[layer] * blocks
        # The window is full until the completion thread settles a submit, which it does
        # within stall_timeout each: wait for it, as long as it runs.
        while not dest.slots.acquire(timeout=self.stall_timeout):
            if dest.thread is None or not dest.thread.is_alive():
                self._fail_items(items, "this destination's completion thread is gone")
                return
        submit_ns = time.monotonic_ns()
        try:
            batch = dest.link.submit(copies)
        except TransferError as e:
            dest.slots.release()
            self._fail_items(items, str(e))
            return
        for request, _ in items:
            if request.first_submit_ns is None:
                request.first_submit_ns = submit_ns
        submit = _Submit(batch, dest, layer, items, nbytes, signal_ns, submit_ns)
        with self._lock:
            inline, reason = dest.outstanding == 0, None  # none before it: done at once?
            if inline:
                try:
                    inline = batch.done()
                except TransferError as e:
                    reason = str(e)
            if not inline and reason is None:
                dest.outstanding += 1
        if inline or reason is not None:
            self._completed(submit, reason)
        else:
            dest.queue.put(submit)

    # ---- completion -----------------------------------------------------------------

    def _complete(self, dest: Destination) -> None:
        """A destination's completion thread: each of its submits in order, waited for."""
        while (submit := dest.queue.get()) is not None:
            reason = None
            try:
                submit.batch.wait(self.stall_timeout)
            except TransferError as e:
                reason = str(e)
            except Exception as e:  # a transport's bug: the transfer failed, say why
                reason = f"the transport failed: {type(e).__name__}: {e}"
            self._completed(submit, reason)
            with self._lock:
                dest.outstanding -= 1

    def _completed(self, submit: _Submit, reason: str | None) -> None:
        """A submit landed (reason None) or failed: its slot goes back, its numbers are
        kept, and the requests it finished end."""
        submit.dest.slots.release()
        self.metrics.layer(
            LayerRecord(
                submit.layer,
                len(submit.items),
                submit.nbytes,
                submit.signal_ns,
                submit.submit_ns,
                time.monotonic_ns(),
                reason is None,
            )
        )
        if reason is not None:
            self._fail_items(submit.items, reason)
            return
        per_block = submit.dest.planner.block_bytes[submit.layer]
        for request, blocks in submit.items:
            with self._lock:
                request.in_flight -= 1
                request.nbytes += per_block * blocks
            self._finish_if_done(request)

    def _finish_if_done(self, request: _Request) -> None:
        with self._lock:
            if request.ended or request.in_flight or request.unsent_layers:
                return
            request.ended = True
        try:
            self._post(request, mailbox.LANDED, "")
        except TransferError as e:
            self._end(request, False, f"the data landed but its status did not: {e}")
            return
        self._end(request, True, "")

    def _fail_items(self, items, reason: str) -> None:
        for request, _ in items:
            with self._lock:
                request.in_flight -= 1
            self.fail(request.id, reason)

    def fail(self, request_id: str, reason: str) -> None:
        """End `request_id` as failed with `reason`, on both sides (the decode side reads it
        in its status slot, or by its deadline if the link is gone)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.ended:
                return
            request.ended = True
        if request.dest is not None:
            try:
                self._post(request, mailbox.FAILED, reason)
            except TransferError:
                pass  # the link is gone: the decode side's deadline ends it there
        self._end(request, False, reason)

    def abort(self, reason: str) -> None:
        """Fail every request not ended (e.g. the prefill worker died)."""
        with self._lock:
            pending = [r.id for r in self._requests.values() if not r.ended]
        for request_id in pending:
            self.fail(request_id, reason)

    def _post(self, request: _Request, state: int, reason: str) -> None:
        """Write the request's outcome to its status slot: a failure's reason first, then the
        word, each landed before the next."""
        dest, ticket = request.dest, request.ticket
        offset = int(ticket["slot"]) * mailbox.SLOT_BYTES
        pieces = [(8, mailbox.reason_bytes(reason))] if state == mailbox.FAILED else []
        pieces.append((0, mailbox.word(int(ticket["generation"]), state)))
        with self._scratch_lock:
            for at, data in pieces:
                ctypes.memmove(self._scratch_address + at, data, len(data))
                run = (self._scratch_address + at, dest.status_region, offset + at, len(data))
                dest.link.submit([run]).wait(self.stall_timeout)

    def _end(self, request: _Request, landed: bool, reason: str) -> None:
        self.metrics.request(
            landed,
            request.nbytes,
            request.first_submit_ns,
            request.last_signal_ns,
            time.monotonic_ns(),
        )
        with self._lock:
            self._requests.pop(request.id, None)
            self._outcomes.append(Outcome(request.id, landed, reason))

    def _expired(self) -> list[tuple[str, str]]:
        """(request, why) of those no decode side claimed within claim_timeout, and of
        those whose decode side is gone (under the lock; failed by the caller, outside it)."""
        now, problems, out = time.monotonic(), {}, []
        self._next_check = now + CHECK_S
        for request in self._requests.values():
            if request.ended:
                continue
            if request.dest is None:
                if now - request.added > self.claim_timeout:
                    out.append(
                        (request.id, f"no decode side claimed it within {self.claim_timeout:g} s")
                    )
                continue
            key = id(request.dest)
            if key not in problems:
                problems[key] = request.dest.link.problem()
            if problems[key]:
                out.append((request.id, problems[key]))
        return out

    # ---- reporting ------------------------------------------------------------------

    def poll(self) -> list[Outcome]:
        """The requests that ended since the last poll (the prefill side may free the
        blocks of each); checks leases and peers first."""
        with self._lock:
            expired = self._expired()
        for request_id, why in expired:
            self.fail(request_id, why)
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def pending(self) -> int:
        """Requests not ended yet."""
        with self._lock:
            return len(self._requests)

    def _retire(self, dest: Destination) -> None:
        """Stop `dest`'s completion thread (after what it has queued) and close its link."""
        dest.queue.put(None)
        if dest.thread is not None and dest.thread is not threading.current_thread():
            dest.thread.join()
        dest.link.close()

    def close(self) -> None:
        """Wait for what is in flight, then fail the requests not ended and close every
        link."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            destinations, self._destinations = list(self._destinations.values()), {}
        for dest in destinations:
            dest.queue.put(None)
        for dest in destinations:
            if dest.thread is not None:
                dest.thread.join()
        self.abort("the streamer was closed")
        for dest in destinations:
            dest.link.close()
