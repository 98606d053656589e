"""The prefill side of layer-wise transfers: as each layer's signal arrives, the blocks it
made ready, of every request whose destination is known, go to the decode side while the
next layers compute.

layer_ready(layer, [(request, tokens in the cache)]) is the whole interface to the signals
(a per-query step's requests, or a per-chunk record's): a request's full blocks go as its
chunks fill them, its last partial block once the prompt is whole. Runs consecutive on both
sides are planned once per step (the same block pairs in every layer). Each destination has
its own window of max_layers_in_flight submits and a thread completing them in order; a
send that finds the window full waits in that destination's backlog, so the caller never
blocks on a slow decode side. A request ends once nothing of it is in flight: landed when
every layer of its prompt has, which its decode side then reads in its status slot, or
failed, which both sides hear. A failure ends the requests it touches, and nothing else.

Transport calls are made outside the streamer's lock."""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdhal._errors import ClosedHandleError, InvalidArgumentError, TransferError
from pdhal._transfer import mailbox
from pdhal._transfer.destination import Destination, Send, StatusBuffers
from pdhal._transfer.heads import HeadShard
from pdhal._transfer.layout import CacheLayout, RunPlanner, block_runs, seconds
from pdhal._transfer.metrics import LayerRecord, TransferMetrics
from pdhal._transfer.outcome import Outcome
from pdhal._transfer.plugins import transport

#: How often layer_ready looks for expired leases and dead peers (poll() always does).
CHECK_S = 0.05
#: The shortest wait for a submit whose stall_timeout passed while it queued: one look.
MIN_WAIT_S = 1e-3
#: Plans (a step's runs) kept; older ones are planned again if asked for.
PLANS = 1024

log = logging.getLogger("pdhal")


@dataclass(eq=False)
class _Request:
    id: str
    given: list[int]  # source blocks of the prompt from block `base` on (more may come)
    prompt_tokens: int  # of the prompt, those that go (the decode side may need fewer)
    added: float
    layers: int
    blocks: int  # the blocks that go: from `cached` to the last of prompt_tokens
    cached: int = 0  # the prompt's first blocks, on the decode side already
    base: int = 0  # add_request's cached blocks (`given` starts after them)
    dest: Destination | None = None
    dst_blocks: list[int] = field(default_factory=list)
    ticket: dict | None = None
    ready: list[int] = field(default_factory=list)  # tokens in the cache, per layer
    sent: list[int] = field(default_factory=list)  # blocks submitted, per layer
    landed: list[int] = field(default_factory=list)  # blocks in the destination, per layer
    layers_landed: int = 0  # layers all of whose blocks are in the destination
    unsent_layers: int = 0  # layers not all of whose blocks were submitted
    in_flight: int = 0  # sends carrying it not settled yet (submitted or in a backlog)
    failed: str | None = None  # why, once it failed
    reported: bool = False  # its outcome is out
    nbytes: int = 0
    first_submit_ns: int | None = None
    last_signal_ns: int | None = None

    def __post_init__(self):
        self.ready, self.sent, self.landed = [0] * self.layers, [0] * self.layers, [0] * self.layers
        self.unsent_layers = self.layers
        self.base = self.cached
        self.needed = self.blocks  # source blocks from `base` to the prompt's end

    @property
    def ended(self) -> bool:
        """Nothing more of it is to be sent."""
        return self.failed is not None or self.reported

    def sendable(self, layer: int, block_tokens: int) -> int:
        """Blocks of `layer` that may go: the full ones, the last partial one once whole,
        of those whose source blocks are known."""
        tokens = self.ready[layer]
        known = min(self.blocks, max(len(self.given) - (self.cached - self.base), 0))
        if tokens >= self.prompt_tokens:
            return known
        return min(max(tokens // block_tokens - self.cached, 0), known)

    def source(self, first: int, end: int) -> list[int]:
        """The source block ids of blocks [first, end) of those that go."""
        skip = self.cached - self.base
        return self.given[skip + first : skip + end]

    def reshape(self, tokens: int, cached: int, block_tokens: int) -> None:
        """Send only the first `tokens` of the prompt, from block `cached` on (the decode
        side's needs, before anything was sent)."""
        self.prompt_tokens, self.cached = tokens, cached
        self.blocks = -(-tokens // block_tokens) - cached

    def mark_sent(self, layer: int, blocks: int) -> None:
        self.sent[layer] = blocks
        if blocks == self.blocks:
            self.unsent_layers -= 1


def _count(value: object, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{what} must be an int >= {low}, got {value!r}")
    return value


class KVStreamer:
    """Streams the KV blocks of requests in `layout` (the prefill caches) to the decode
    sides they are assigned to, layer by layer.

    `on_outcome`: called with each request's Outcome on the thread that ended it (a
    completion thread, or the caller's), for a messager whose thread is blocked on the next
    signal while the prefill side waits for blocks to come free; poll() then returns none.
    It must be quick; what it raises is logged and dropped."""

    def __init__(
        self,
        layout: CacheLayout,
        block_tokens: int,
        *,
        transport_name: str = "shm",
        max_layers_in_flight: int = 4,
        stall_timeout: float = 10.0,
        claim_timeout: float = 60.0,
        on_outcome: Callable[[Outcome], None] | None = None,
    ):
        if not isinstance(layout, CacheLayout):
            raise InvalidArgumentError(f"layout must be a CacheLayout, got {layout!r}")
        self.layout = layout
        self.block_tokens = _count(block_tokens, "block_tokens", 1)
        self._window = _count(max_layers_in_flight, "max_layers_in_flight", 1)
        self.stall_timeout = seconds(stall_timeout, "stall_timeout")
        self.claim_timeout = seconds(claim_timeout, "claim_timeout")
        if on_outcome is not None and not callable(on_outcome):
            raise InvalidArgumentError(f"on_outcome must be callable, got {on_outcome!r}")
        self._on_outcome = on_outcome
        self._transport = transport(transport_name)
        self._src_blocks = min(spec.blocks for caches in layout.layers for spec in caches)
        self._lock = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._outcomes: list[Outcome] = []
        self._plans: dict[tuple, list] = {}  # (destination, the step's spans) -> its runs
        self._destinations: dict[str, Destination] = {}  # by their description
        self.metrics = TransferMetrics()
        self._next_check = 0.0
        self._closed = False

    # ---- destinations and requests --------------------------------------------------

    def connect(self, described: dict, *, heads: HeadShard | None = None) -> Destination:
        """The decode side `described` (a KVReceiver's describe()), connected once: its
        layout is checked to pair with this one cache by cache. `heads`: only that shard's
        KV heads go there (a decode rank of another tensor-parallel split; head_shards),
        both sides' heads checked to pair before anything moves."""
        self._open()
        if heads is not None and not isinstance(heads, HeadShard):
            raise InvalidArgumentError(f"heads must be a HeadShard, got {heads!r}")
        if not isinstance(described, dict):
            raise InvalidArgumentError(
                f"described must be a receiver's describe(), got {described!r}"
            )
        missing = [
            k for k in ("layout", "regions", "status_region", "status_slots") if k not in described
        ]
        if missing:
            raise InvalidArgumentError(
                f"described lacks {', '.join(missing)}: pass a KVReceiver's describe()"
            )
        key = json.dumps([described, heads and vars(heads)], sort_keys=True, default=str)
        with self._lock:
            known = self._destinations.get(key)
        if known is not None and known.link.problem() is None:
            return known
        layers = self.layout.check_peer(described["layout"], heads)
        source = (
            self.layout if heads is None else self.layout.head_view(heads.src_first, heads.count)
        )
        status_region = _count(described["status_region"], "status_region")
        if status_region >= len(described["regions"]):
            raise InvalidArgumentError(
                f"status_region {status_region} is not one of the {len(described['regions'])} "
                f"regions described"
            )
        status = StatusBuffers()
        link = self._transport.connect(
            described, [*self.layout.regions, (status.address, status.nbytes)]
        )
        dest = Destination(
            link,
            RunPlanner(source, layers),
            status_region,
            _count(described["status_slots"], "status_slots", 1),
            self._window,
            status,
        )
        dest.thread = threading.Thread(
            target=self._complete, args=(dest,), name="pdhal-transfer-completion", daemon=True
        )
        dest.thread.start()
        with self._lock:
            stale = self._destinations.get(key)
            self._destinations[key] = dest
        if stale is not None:  # its requests fail by its problem; new ones go here
            self._fail_users(stale, stale.link.problem() or "its decode side reconnected")
            self._retire(stale)
        return dest

    def add_request(
        self, request_id: str, src_blocks, prompt_tokens: int, cached_blocks: int = 0
    ) -> None:
        """A request whose KV is (or will be) in `src_blocks` of the prefill caches, its
        prompt `prompt_tokens` long; failed if no destination is set within claim_timeout.
        `cached_blocks`: the prompt's first blocks, which the decode side has already (a
        prefix it cached): not sent, and not in `src_blocks`. `src_blocks` may be the first
        of them only (an engine that allocates a chunked prompt's blocks chunk by chunk):
        add_blocks gives the rest."""
        self._open()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        tokens = _count(prompt_tokens, "prompt_tokens", 1)
        cached = _count(cached_blocks, "cached_blocks")
        whole = -(-tokens // self.block_tokens)
        if cached >= whole:
            raise InvalidArgumentError(
                f"request {request_id!r}: {cached} cached blocks leave nothing of a prompt of "
                f"{tokens} tokens in blocks of {self.block_tokens} to send"
            )
        src = self._source_blocks(request_id, src_blocks, whole - cached, 0)
        with self._lock:
            if request_id in self._requests:
                raise InvalidArgumentError(f"request {request_id!r} was added already")
            self._requests[request_id] = _Request(
                request_id,
                src,
                tokens,
                time.monotonic(),
                self.layout.num_layers,
                whole - cached,
                cached,
            )

    def add_blocks(self, request_id: str, src_blocks) -> None:
        """More of `request_id`'s source blocks, after those it has: the layers they make
        sendable go at once (if its destination is known)."""
        self._open()
        with self._lock:
            request = self._live(request_id)
            src = self._source_blocks(request_id, src_blocks, request.needed, len(request.given))
            request.given += src
            dest = request.dest
        if dest is not None:
            self._send_ready(request)

    def _source_blocks(self, request_id: str, blocks, needed: int, have: int) -> list[int]:
        """`blocks` as source block ids, checked: ids within the caches, at most `needed`
        with the `have` given before."""
        src = list(blocks)
        if have + len(src) > needed:
            raise InvalidArgumentError(
                f"request {request_id!r} needs {needed} source blocks; {have} given, then "
                f"{len(src)} more"
            )
        block_runs(src, src)  # the ids are ids
        if src and max(src) >= self._src_blocks:
            raise InvalidArgumentError(
                f"request {request_id!r}: source block {max(src)} is outside the prefill "
                f"caches' {self._src_blocks} blocks"
            )
        return src

    def set_destination(
        self,
        request_id: str,
        dest: Destination,
        dst_blocks,
        ticket,
        *,
        tokens: int | None = None,
        cached_blocks: int | None = None,
    ) -> None:
        """Where `request_id` goes: blocks `dst_blocks` of `dest`'s caches, its outcome to
        the status slot of `ticket` (the decode side's expect()). The layers ready already
        go at once. What the decode side needs, if it says: only the prompt's first
        `tokens` (vLLM's decode computes the last prompt token itself), from block
        `cached_blocks` on (a prefix it cached, at least add_request's); `dst_blocks` are
        the blocks from there to the last of those tokens."""
        self._open()
        if not isinstance(dest, Destination) or dest not in self._destinations.values():
            raise InvalidArgumentError(
                f"dest must come from this streamer's connect(), got {dest!r}"
            )
        dst = list(dst_blocks)
        if not isinstance(ticket, dict):
            raise InvalidArgumentError(f"ticket must be the receiver's expect(), got {ticket!r}")
        slot = _count(ticket.get("slot"), "the ticket's slot")
        _count(ticket.get("generation"), "the ticket's generation")
        if not isinstance(ticket.get("layerwise", False), bool):
            raise InvalidArgumentError(
                f"the ticket's layerwise must be a bool, got {ticket['layerwise']!r}"
            )
        if slot >= dest.status_slots:
            raise InvalidArgumentError(
                f"the ticket's slot {slot} is outside the receiver's {dest.status_slots} slots"
            )
        with self._lock:
            request = self._live(request_id)
            if request.dest is not None:
                raise InvalidArgumentError(f"request {request_id!r} has a destination already")
            need = request.prompt_tokens if tokens is None else _count(tokens, "tokens", 1)
            skip = (
                request.cached if cached_blocks is None else _count(cached_blocks, "cached_blocks")
            )
            if not request.cached <= skip < -(-need // self.block_tokens) or (
                need > request.prompt_tokens
            ):
                raise InvalidArgumentError(
                    f"request {request_id!r}: its decode side needs {need} tokens from block "
                    f"{skip} on; the prompt has {request.prompt_tokens} tokens from block "
                    f"{request.cached} on, and something must be left to send"
                )
            wanted = -(-need // self.block_tokens) - skip
            if len(dst) != wanted:
                raise InvalidArgumentError(
                    f"request {request_id!r}: {need} tokens from block {skip} on are {wanted} "
                    f"destination blocks, got {len(dst)}"
                )
            block_runs(dst, dst)  # the ids are ids
            if dst and max(dst) >= dest.planner.dst_blocks:
                raise InvalidArgumentError(
                    f"request {request_id!r}: destination block {max(dst)} is outside the "
                    f"decode caches' {dest.planner.dst_blocks} blocks"
                )
            request.reshape(need, skip, self.block_tokens)  # nothing of it went yet
            request.dest, request.dst_blocks, request.ticket = dest, dst, dict(ticket)
        self._send_ready(request)
        self._settle(request)

    def _send_ready(self, request: _Request) -> None:
        """Send what of `request` is sendable and was not sent, layer by layer."""
        with self._lock:
            dest = request.dest
            layers = [
                layer
                for layer in range(request.layers)
                if request.sendable(layer, self.block_tokens) > request.sent[layer]
            ]
        now = time.monotonic_ns()
        for layer in layers:
            self._send(dest, layer, [request], now)

    def _live(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidArgumentError(f"request {request_id!r} is unknown (or ended)")
        return request

    def _open(self) -> None:
        if self._closed:
            raise ClosedHandleError("the streamer was closed")

    # ---- the signals --------------------------------------------------------------

    def layer_ready(
        self, layer: int, ready, signal_ns: int | None = None, *, step: int | None = None
    ) -> None:
        """Layer `layer` now holds `tokens` of each (request_id, tokens) in `ready`: send
        what became ready. `signal_ns`: when the signal was seen (time.monotonic_ns());
        `step`: the engine's step, kept in the layer's metrics record."""
        signal_ns = time.monotonic_ns() if signal_ns is None else signal_ns
        self._open()
        if step is not None:
            _count(step, "step")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise InvalidArgumentError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgumentError(
                f"layer {layer} is outside the layout's {self.layout.num_layers} layers"
            )
        try:
            entries = [(request_id, _count(tokens, "tokens")) for request_id, tokens in ready]
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidArgumentError):
                raise
            raise InvalidArgumentError(
                f"ready must be (request_id, tokens) pairs, got {ready!r}"
            ) from None
        if time.monotonic() >= self._next_check:
            self._fail_expired()
        by_dest: dict[int, tuple[Destination, list[_Request]]] = {}
        with self._lock:
            for request_id, tokens in entries:
                request = self._requests.get(request_id)
                if request is None or request.ended:
                    continue  # ended (failed) already: its later layers go nowhere
                request.ready[layer] = max(request.ready[layer], tokens)
                if layer == request.layers - 1 and tokens >= request.prompt_tokens:
                    request.last_signal_ns = signal_ns
                if request.dest is None:
                    continue
                if request.sendable(layer, self.block_tokens) > request.sent[layer]:
                    by_dest.setdefault(id(request.dest), (request.dest, []))[1].append(request)
        for dest, requests in by_dest.values():
            self._send(dest, layer, requests, signal_ns, step)

    def _send(
        self,
        dest: Destination,
        layer: int,
        requests: list[_Request],
        signal_ns: int,
        step: int | None = None,
    ):
        """Send the newly sendable blocks of `requests` in `layer` to `dest`."""
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
            key = (dest, tuple(spans))  # every layer of a step sends the same spans
            runs = self._plans.get(key)
        if runs is None:
            src, dst = [], []
            for request, first, end in spans:
                src += request.source(first, end)
                dst += request.dst_blocks[first:end]
            runs = block_runs(src, dst)  # ids checked when the request and its destination came
            with self._lock:
                if len(self._plans) >= PLANS:
                    self._plans.clear()
                self._plans[key] = runs
        blocks = sum(n for _, n in items)
        copies = dest.planner.copies(layer, runs)
        send = Send(layer, items, copies, dest.planner.block_bytes[layer] * blocks, signal_ns, step)
        with self._lock:
            dest.backlog.append(send)
        self._pump(dest)

    def _pump(self, dest: Destination) -> None:
        """Submit `dest`'s backlog, in order, as its window has room."""
        while True:
            with self._lock:
                if not dest.backlog or not dest.window.acquire(blocking=False):
                    return
                send = dest.backlog.popleft()
            self._submit(dest, send)

    def _submit(self, dest: Destination, send: Send) -> None:
        """Submit `send` (it holds a window slot); settle it at once if it landed at once
        and nothing of `dest` is before it, else hand it to `dest`'s completion thread."""
        with self._lock:
            live = any(not request.ended for request, _ in send.items)
        if not live:  # every request it carries failed meanwhile: nothing to send
            self._settled(dest, send, "")
            return
        send.submit_ns = time.monotonic_ns()
        try:
            send.batch = dest.link.submit(send.copies)
        except Exception as e:  # TransferError, or a transport's bug
            self._settled(dest, send, _why(e))
            return
        with self._lock:
            for request, _ in send.items:
                if request.first_submit_ns is None:
                    request.first_submit_ns = send.submit_ns
            first = dest.outstanding == 0
            dest.outstanding += 1
        reason = None
        if first:
            try:
                landed = send.batch.done()
            except Exception as e:
                landed, reason = False, _why(e)
            if landed or reason is not None:
                self._settled(dest, send, reason)
                with self._lock:
                    dest.outstanding -= 1
                return
        dest.queue.put(send)

    # ---- completion -----------------------------------------------------------------

    def _complete(self, dest: Destination) -> None:
        """`dest`'s completion thread: each of its submits in order, waited for until
        stall_timeout after it was submitted (the submits queued behind a stalled one do
        not each wait it again); a retired destination's link is closed after its last."""
        while (send := dest.queue.get()) is not None:
            try:
                left = send.submit_ns / 1e9 + self.stall_timeout - time.monotonic()
                send.batch.wait(max(left, MIN_WAIT_S))
                reason = None
            except Exception as e:  # TransferError, or a transport's bug: the send failed
                reason = _why(e)
            try:
                self._settled(dest, send, reason)
            finally:
                with self._lock:
                    dest.outstanding -= 1
        if dest.retired:
            self._drop_unsettled(dest)
            dest.link.close()

    def _drop_unsettled(self, dest: Destination) -> None:
        """After `dest`'s thread stopped: what it never settled (queued behind its stop, or
        never given a window) is waited for one last time and dropped, so its requests can
        end."""
        left = []
        while True:
            try:
                send = dest.queue.get_nowait()
            except Exception:  # queue.Empty
                break
            if send is not None:
                left.append(send)
        with self._lock:
            left += list(dest.backlog)
            dest.backlog.clear()
        for send in left:
            if send.batch is not None:
                try:
                    send.batch.wait(self.stall_timeout)
                except Exception:
                    pass  # it failed or stalled: dropped either way
            with self._lock:
                for request, _ in send.items:
                    request.in_flight -= 1
                    if request.failed is None and not request.reported:
                        request.failed = "the streamer stopped sending to this decode side"
            for request, _ in send.items:
                self._settle(request)

    def _settled(self, dest: Destination, send: Send, reason: str | None) -> None:
        """`send` landed (reason None), failed, or was dropped (""): its window slot goes
        back, its numbers are kept, its requests are settled, the backlog moves on."""
        dest.window.release()
        if reason != "":
            self.metrics.layer(
                LayerRecord(
                    send.layer,
                    len(send.items),
                    send.nbytes,
                    send.signal_ns,
                    send.submit_ns,
                    time.monotonic_ns(),
                    reason is None,
                    send.step,
                )
            )
        per_block = dest.planner.block_bytes[send.layer]
        for request, blocks in send.items:
            with self._lock:
                request.in_flight -= 1
                if reason is None:
                    request.nbytes += per_block * blocks
                    progressed = self._landed(request, send.layer, blocks)
                elif reason and request.failed is None and not request.reported:
                    request.failed = reason
            if reason is None and progressed:
                self._post_progress(request)
            self._settle(request)
        self._pump(dest)

    @staticmethod
    def _landed(request: _Request, layer: int, blocks: int) -> bool:
        """Count `blocks` of `layer` as in the destination (under the lock); whether the
        request's decode side is to hear of a layer that landed whole (a layerwise ticket;
        the last layer's news is the outcome itself)."""
        request.landed[layer] += blocks
        if request.landed[layer] < request.blocks:
            return False
        request.layers_landed += 1
        return bool(request.ticket.get("layerwise")) and request.layers_landed < request.layers

    def _post_progress(self, request: _Request) -> None:
        """Tell a layerwise ticket's decode side how many layers landed; a write that fails
        fails the request."""
        with self._lock:
            if request.ended:
                return
            layers = request.layers_landed
        piece = mailbox.progress(int(request.ticket["generation"]), layers)
        try:
            self._write_slot(request, [(mailbox.PROGRESS_AT, piece)])
        except TransferError as e:
            with self._lock:
                if request.failed is None and not request.reported:
                    request.failed = str(e)

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` was added and has not ended."""
        with self._lock:
            request = self._requests.get(request_id)
            return request is not None and not request.ended

    def fail(self, request_id: str, reason: str) -> None:
        """End `request_id` as failed with `reason`, on both sides (the decode side reads it
        in its status slot, or by its deadline if the link is gone), once nothing of it is
        in flight any more."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.ended:
                return
            request.failed = str(reason)
        self._settle(request)

    def abort(self, reason: str) -> None:
        """Fail every request not ended (e.g. the prefill worker died)."""
        with self._lock:
            pending = [r.id for r in self._requests.values() if not r.ended]
        for request_id in pending:
            self.fail(request_id, reason)

    def _settle(self, request: _Request) -> None:
        """Report `request` if it is over and nothing of it is in flight: landed when every
        layer went, failed when it failed."""
        with self._lock:
            if request.reported or request.in_flight:
                return
            if request.failed is None and (request.dest is None or request.unsent_layers):
                return
            request.reported = True
            landed, reason = request.failed is None, request.failed or ""
        if request.dest is not None:
            try:
                self._post(request, mailbox.LANDED if landed else mailbox.FAILED, reason)
            except TransferError as e:
                if landed:  # the decode side ends it by its deadline
                    landed, reason = False, f"the data landed but its status did not: {e}"
        self.metrics.request(
            landed,
            request.nbytes,
            request.first_submit_ns,
            request.last_signal_ns,
            time.monotonic_ns(),
        )
        outcome = Outcome(request.id, landed, reason)
        with self._lock:
            self._requests.pop(request.id, None)
            if self._on_outcome is None:
                self._outcomes.append(outcome)
        if self._on_outcome is not None:
            try:
                self._on_outcome(outcome)
            except Exception:
                log.exception("pdhal.transfer: on_outcome raised for %s", outcome)

    def _post(self, request: _Request, state: int, reason: str) -> None:
        """Write the request's outcome to its status slot: a failure's reason first, then the
        word, each landed before the next, from a buffer no unsettled submit may still read."""
        generation = int(request.ticket["generation"])
        pieces = []
        if state == mailbox.FAILED:
            pieces.append((mailbox.REASON_AT, mailbox.reason_bytes(generation, reason)))
        pieces.append((0, mailbox.word(generation, state)))
        self._write_slot(request, pieces)

    def _write_slot(self, request: _Request, pieces: list[tuple[int, bytes]]) -> None:
        """Write each (offset in the slot, bytes) of `pieces` to the request's status slot,
        each landed before the next."""
        dest = request.dest
        offset = int(request.ticket["slot"]) * mailbox.SLOT_BYTES
        for at, data in pieces:
            buffer = dest.status.take()
            if buffer is None:
                raise TransferError("every status buffer is held by a write that never settled")
            ctypes.memmove(buffer, data, len(data))
            try:
                batch = dest.link.submit([(buffer, dest.status_region, offset + at, len(data))])
                batch.wait(self.stall_timeout)
            except Exception as e:
                raise TransferError(_why(e)) from None  # the buffer stays out: poisoned
            dest.status.give_back(buffer)

    # ---- leases and peers ---------------------------------------------------------

    def _fail_expired(self) -> None:
        """Fail the requests no decode side claimed within claim_timeout, and those whose
        decode side is gone; retire gone decode sides nothing uses any more."""
        now = time.monotonic()
        self._next_check = now + CHECK_S
        with self._lock:
            unclaimed = [
                r.id
                for r in self._requests.values()
                if r.dest is None and not r.ended and now - r.added > self.claim_timeout
            ]
            destinations = list(self._destinations.items())
        for request_id in unclaimed:
            self.fail(request_id, f"no decode side claimed it within {self.claim_timeout:g} s")
        for key, dest in destinations:
            why = dest.link.problem()
            if why is None:
                continue
            self._fail_users(dest, why)
            with self._lock:
                idle = not any(r.dest is dest for r in self._requests.values())
                if idle and self._destinations.get(key) is dest:
                    del self._destinations[key]
                else:
                    idle = False
            if idle:
                self._retire(dest)

    def _fail_users(self, dest: Destination, why: str) -> None:
        with self._lock:
            users = [r.id for r in self._requests.values() if r.dest is dest]
        for request_id in users:
            self.fail(request_id, why)

    # ---- reporting ------------------------------------------------------------------

    def poll(self) -> list[Outcome]:
        """The requests that ended since the last poll (the prefill side may free the
        blocks of each); checks leases and peers first."""
        if not self._closed:
            self._fail_expired()
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def pending(self) -> int:
        """Requests not reported yet."""
        with self._lock:
            return len(self._requests)

    def _retire(self, dest: Destination) -> None:
        """Stop `dest`'s completion thread once it settled what it has queued; it closes the
        link then (the caller does not wait for a stalled decode side)."""
        dest.retired = True
        dest.queue.put(None)

    def close(self) -> None:
        """Wait for what is in flight, then fail the requests not ended and close every
        link."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            destinations = list(self._destinations.values())
        for dest in destinations:
            dest.queue.put(None)
        for dest in destinations:
            if dest.thread is not None:
                dest.thread.join()
            self._drop_unsettled(dest)
        self.abort("the streamer was closed")
        with self._lock:
            left = list(self._requests.values())
        for request in left:
            self._settle(request)
        with self._lock:
            self._destinations.clear()
        for dest in destinations:
            dest.link.close()


def _why(error: Exception) -> str:
    """A failure's reason: a TransferError's message, or what a transport's bug raised."""
    if isinstance(error, TransferError):
        return str(error)
    return f"the transport failed: {type(error).__name__}: {error}"
