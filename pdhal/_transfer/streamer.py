"""The prefill side of layer-wise transfers: as each layer's signal arrives, the blocks it
made ready, of every request whose destination is known, go to the decode side while the
next layers compute.

layer_ready(layer, [(request, tokens in the cache)]) is the whole interface to the signals
(a per-query step's requests, or a per-chunk record's): a request's full blocks go as its
chunks fill them, its last partial block once the prompt is whole. Runs consecutive on both
sides are planned once per step (the same block pairs in every layer) and handed to the
request's Destination, an active object that submits and completes them on threads of its
own: no call here waits on a decode side, and no copy runs on the caller's thread but a
staging one (caches the transport cannot reach: each layer's blocks copied into their
pinned host mirror through the runtime, staging.py).

A request's life is the state machine of request.py; it ends exactly once, landed when
every layer of it landed (its decode side then reads LANDED in its status slot) or failed
(the reason written there too, unless its link broke). Its leases and its decode side's
liveness are kept by the streamer's own clock (keeper.py), not by the caller's polls.

Every argument is checked at the call that gives it (checks.py), so a bad one fails only
that call, never a later layer or another request's send."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from pdhal._errors import ClosedHandleError, InvalidArgumentError, PdhalError
from pdhal._protocol import core as _core
from pdhal._protocol.signals import ProgressReader
from pdhal._transfer import checks, keeper, mailbox
from pdhal._transfer.contract import (
    Gate,
    require_claimed_kinds,
    require_memory,
    require_pairs,
    require_target_completion,
)
from pdhal._transfer.destination import Destination, Send, StatusWrite, Write
from pdhal._transfer.heads import HeadShard
from pdhal._transfer.keeper import Clock, Deadlines
from pdhal._transfer.layout import BlockRuns, CacheLayout, RunPlanner, extend_runs, units_of
from pdhal._transfer.metrics import LayerRecord, TransferMetrics
from pdhal._transfer.outcome import Outcome, Outcomes
from pdhal._transfer.plugins import transport
from pdhal._transfer.request import Action, Request, State
from pdhal._transfer.staging import Staging, needs_staging

#: How often a decode side with requests in flight is checked for liveness (a link's
#: problem() is a probe: a dead peer sends no wake).
PEER_CHECK_S = 0.1
#: Plans (a step's runs) kept; older ones are planned again if asked for.
PLANS = 1024
#: The largest step a per-query progress word holds.
MAX_STEP = (1 << (64 - _core.LAYER_BITS)) - 1
#: A status slot's generation is 56 bits (mailbox.word).
GENERATIONS = (1 << 56) - 1

log = logging.getLogger("pdhal")


def _channel(segment) -> tuple[str, int]:
    """A per-query channel, as follow() keeps its steps: its path and its producer."""
    return segment.path, segment.creator_pid


class KVStreamer:
    """Streams the KV blocks of requests in `layout` (the prefill caches) to the decode
    sides they are assigned to, layer by layer. Thread-safe: every method may be called
    from any thread; none blocks on a decode side.

    `on_outcome`: called with each request's Outcome on the thread that ended it (one of
    a destination's threads, the streamer's clock, or the caller's), for a messager whose
    thread is blocked on the next signal; poll() then returns none. It must be quick; what
    it raises is logged and dropped. `clock`: what its leases and deadlines are read on
    (time.monotonic(); a test passes pdhal.testing.ManualClock)."""

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
        clock: Clock | None = None,
    ):
        if not isinstance(layout, CacheLayout):
            raise InvalidArgumentError(f"layout must be a CacheLayout, got {layout!r}")
        self.layout = layout
        self.block_tokens = checks.integer(block_tokens, "block_tokens", 1)
        self._window = checks.integer(max_layers_in_flight, "max_layers_in_flight", 1, 1024)
        self.stall_timeout = checks.seconds(stall_timeout, "stall_timeout")
        self.claim_timeout = checks.seconds(claim_timeout, "claim_timeout")
        if on_outcome is not None and not callable(on_outcome):
            raise InvalidArgumentError(f"on_outcome must be callable, got {on_outcome!r}")
        self._on_outcome = on_outcome
        clock = keeper.checked(clock)
        self._transport = transport(transport_name)
        require_target_completion(self._transport)  # a LANDED word never beats its bytes
        #: where its transport copies from: the caches, or their pinned host mirror (staging)
        self._staging = (
            Staging(layout, self._transport.memory)
            if needs_staging(self._transport, layout)
            else None
        )
        self._served = layout if self._staging is None else self._staging.mirror
        try:
            require_memory(self._transport, self._served.memory, "the prefill caches'")
            self._unpin = layout.pin("KVStreamer")  # no free of the caches while it copies
        except BaseException:
            if self._staging is not None:
                self._staging.close()
            raise
        self._src_blocks = layout.num_blocks
        self._lock = threading.RLock()
        self._requests: dict[str, Request] = {}
        self._outcomes = Outcomes()
        self._plans: dict[tuple, BlockRuns] = {}  # (destination, the step's spans) -> its runs
        #: per-query channel (its path, its producer) -> the last step followed there; one
        #: follow() at a time, so that a link's gates queue in the steps' order
        self._followed: dict[tuple[str, int], int] = {}
        self._following = threading.Lock()
        self._destinations: dict[str, Destination] = {}  # by their description
        self._watched: set[Destination] = set()  # those with a peer check scheduled
        self.metrics = TransferMetrics()
        self._closed = False
        self._clock = Deadlines("pdhal-transfer-clock", clock)

    # ---- destinations and requests --------------------------------------------------

    def connect(
        self,
        described: dict,
        *,
        heads: HeadShard | None = None,
        block_tokens: int | None = None,
    ) -> Destination:
        """The decode side `described` (a KVReceiver's describe()), connected once: its
        layout is checked to pair with this one cache by cache. `heads`: only that shard's
        KV heads go there (a decode rank of another tensor-parallel split; head_shards),
        both sides' heads checked to pair before anything moves. `block_tokens`: the
        tokens of a block there, when not this side's: each head's tokens then go to
        where that side's blocks hold them (a token of a head the same bytes on both)."""
        self._open()
        if heads is not None and not isinstance(heads, HeadShard):
            raise InvalidArgumentError(f"heads must be a HeadShard, got {heads!r}")
        there = self.block_tokens
        if block_tokens is not None:
            there = checks.integer(block_tokens, "block_tokens", 1, 1 << 20)
        if not isinstance(described, dict):
            raise InvalidArgumentError(
                f"described must be a receiver's describe(), got {described!r}"
            )
        missing = [
            k
            for k in ("layout", "regions", "status_region", "status_slots", "receiver")
            if k not in described
        ]
        if missing:
            raise InvalidArgumentError(
                f"described lacks {', '.join(missing)}: pass a KVReceiver's describe()"
            )
        try:
            key = json.dumps([described, heads and vars(heads), there], sort_keys=True)
        except (TypeError, ValueError, RecursionError) as e:
            raise InvalidArgumentError(f"described is not JSON-able data: {e}") from None
        with self._lock:
            known = self._destinations.get(key)
        if known is not None:
            return known
        receiver = checks.name(described["receiver"], "described's receiver")
        if not isinstance(described["regions"], list):
            raise InvalidArgumentError(
                f"described's regions must be a list, got {described['regions']!r}"
            )
        regions = len(described["regions"])
        status_region = checks.integer(
            described["status_region"], "described's status_region", 0, regions - 1
        )
        slots = checks.integer(described["status_slots"], "described's status_slots", 1, 1 << 16)
        status_bytes = checks.integer(
            described["regions"][status_region], "described's status region bytes"
        )
        if status_bytes < slots * mailbox.SLOT_BYTES:
            raise InvalidArgumentError(
                f"described's status region holds {status_bytes} bytes, less than its "
                f"{slots} slots of {mailbox.SLOT_BYTES}"
            )
        layout = described["layout"]
        sizes = layout.get("regions") if isinstance(layout, dict) else None
        if not isinstance(sizes, list) or status_region < len(sizes):
            raise InvalidArgumentError(
                f"described's layout must list its regions, before the status region "
                f"{status_region}: got {sizes!r}"
            )
        if described["regions"][: len(sizes)] != sizes:
            raise InvalidArgumentError(
                f"described's layout claims regions of {sizes} bytes, its transport serves "
                f"{described['regions'][: len(sizes)]}: a description must not claim more "
                f"than it serves"
            )
        require_pairs(self._transport, self._served.kinds, layout.get("memory"), len(sizes))
        units_of(self.block_tokens, there)  # (refused before the layouts are compared)
        served = self._served  # (the runs' addresses are those the link copies from)
        layers = served.check_peer(layout, heads, (self.block_tokens, there))
        source = served if heads is None else served.head_view(heads.src_first, heads.count)

        kinds = self._transport.source_kinds  # each source's kind too (the status words': host)
        sources = [
            (*span, kind) if kinds else span for span, kind in zip(served.regions, served.kinds)
        ]

        def link(status: tuple[int, int]):
            made = self._transport.connect(
                described, [*sources, (*status, "cpu") if kinds else status]
            )
            try:
                require_claimed_kinds(made, layout.get("memory"))
            except BaseException:
                made.close()
                raise
            return made

        dest = Destination(
            link,
            RunPlanner(source, layers, (self.block_tokens, there)),
            status_region,
            slots,
            receiver,
            self._window,
            self.stall_timeout,
            self._write_settled,
            self._broken,
            posts=getattr(self._transport, "posts", False) is True,
        )
        with self._lock:
            known = self._destinations.setdefault(key, dest)
        if known is not dest:  # another thread connected it meanwhile
            dest.stop(time.monotonic())
        return known

    def add_request(
        self, request_id: str, src_blocks, prompt_tokens: int, cached_blocks: int = 0
    ) -> None:
        """A request whose KV is (or will be) in `src_blocks` of the prefill caches, its
        prompt `prompt_tokens` long; failed if no destination is set within claim_timeout.
        `cached_blocks`: the prompt's first blocks, which the decode side has already (a
        prefix it cached): not sent, and not in `src_blocks`. `src_blocks` may be the first
        of them only (an engine that allocates a chunked prompt's blocks chunk by chunk):
        add_blocks gives the rest, within claim_timeout of the prompt being whole."""
        self._open()
        request_id = checks.name(request_id, "request_id")
        tokens = checks.integer(prompt_tokens, "prompt_tokens", 1)
        cached = checks.integer(cached_blocks, "cached_blocks")
        whole = -(-tokens // self.block_tokens)
        if cached >= whole:
            raise InvalidArgumentError(
                f"request {request_id!r}: {cached} cached blocks leave nothing of a prompt of "
                f"{tokens} tokens in blocks of {self.block_tokens} to send"
            )
        src = self._source_blocks(request_id, src_blocks, whole - cached, 0)
        request = Request(
            request_id,
            src,
            tokens,
            self.layout.num_layers,
            whole - cached,
            cached,
            block_tokens=self.block_tokens,
        )
        with self._lock:
            if request_id in self._requests:
                raise InvalidArgumentError(f"request {request_id!r} was added already")
            self._requests[request_id] = request
        self._clock.after(self.claim_timeout, lambda: self._claim_expired(request))

    def add_blocks(self, request_id: str, src_blocks) -> None:
        """More of `request_id`'s source blocks, after those it has: the layers they make
        sendable go at once (if its destination is known)."""
        self._open()
        request_id = checks.name(request_id, "request_id")
        with self._lock:
            request = self._live(request_id)
            have = len(request.given)
        src = self._source_blocks(request_id, src_blocks, request.needed, have)
        with self._lock:
            if len(request.given) != have or not request.live:
                raise InvalidArgumentError(
                    f"request {request_id!r} changed while its blocks were given (add_blocks "
                    f"from two threads at once?)"
                )
            request.given += src
        self._send_ready(request)

    def _source_blocks(self, request_id: str, blocks, needed: int, have: int) -> list[int]:
        """`blocks` as source block ids, checked: ids within the caches, at most `needed`
        with the `have` given before."""
        src = checks.block_ids(blocks, "src_blocks", self._src_blocks, "prefill caches")
        if have + len(src) > needed:
            raise InvalidArgumentError(
                f"request {request_id!r} needs {needed} source blocks; {have} given, then "
                f"{len(src)} more"
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
        the status slot of `ticket` (the decode side's expect() for this very request, from
        the receiver `dest` was connected to). The layers ready already go at once. What
        the decode side needs, if it says: only the prompt's first `tokens` (vLLM's decode
        computes the last prompt token itself), from block `cached_blocks` on (a prefix it
        cached, at least add_request's); `dst_blocks` are the blocks from there to the last
        of those tokens, each once (and, where the ticket carries their digest, the blocks
        its receiver's expect() was given)."""
        self._open()
        request_id = checks.name(request_id, "request_id")
        with self._lock:
            self._live(request_id)
            ours = isinstance(dest, Destination) and dest in self._destinations.values()
        if not ours:
            raise InvalidArgumentError(
                f"dest must come from this streamer's connect(), got {dest!r}"
            )
        slot, generation, layerwise, deadline_s = self._ticket(request_id, dest, ticket)
        dst = checks.block_ids(
            dst_blocks, "dst_blocks", dest.planner.dst_blocks, "decode caches", unique=True
        )
        said = ticket.get("blocks")  # (the receiver's digest of what it expects there)
        if said is not None and not isinstance(said, str):
            raise InvalidArgumentError(
                f"the ticket's blocks must be the digest its receiver wrote, got {said!r}"
            )
        if said is not None and said != checks.blocks_digest(dst):
            raise InvalidArgumentError(
                f"request {request_id!r}: dst_blocks are not the blocks its decode side's "
                f"expect() was given (a staging receiver copies only those): pass the same "
                f"blocks to both"
            )
        need = None if tokens is None else checks.integer(tokens, "tokens", 1)
        skip = None if cached_blocks is None else checks.integer(cached_blocks, "cached_blocks")
        with self._lock:
            request = self._live(request_id)
            if request.state is not State.ADDED:
                raise InvalidArgumentError(f"request {request_id!r} has a destination already")
            planner = dest.planner
            there = planner.unit_tokens * planner.units[1]  # the decode side's block tokens
            need = request.prompt_tokens if need is None else need
            if skip is None:  # the prefix add_request said, as the decode side's blocks
                skip, part = divmod(request.cached * self.block_tokens, there)
                if part:
                    raise InvalidArgumentError(
                        f"request {request_id!r}: its {request.cached} cached blocks of "
                        f"{self.block_tokens} tokens are not whole blocks of {there} tokens "
                        f"there: give cached_blocks"
                    )
            if there != self.block_tokens and request.cached * self.block_tokens > skip * there:
                raise InvalidArgumentError(
                    f"request {request_id!r}: its decode side's prefix ({skip} blocks of "
                    f"{there} tokens) is shorter than add_request's ({request.cached} blocks "
                    f"of {self.block_tokens}): the tokens between have no source block"
                )
            if not (
                request.cached * self.block_tokens <= skip * there
                and skip < -(-need // there)
                and need <= request.prompt_tokens
            ):
                sizes = (
                    f" (blocks of {there} tokens there, {self.block_tokens} here)"
                    if there != self.block_tokens
                    else ""
                )
                raise InvalidArgumentError(
                    f"request {request_id!r}: its decode side needs {need} tokens from block "
                    f"{skip} on; the prompt has {request.prompt_tokens} tokens from block "
                    f"{request.cached} on{sizes}, and something must be left to send"
                )
            wanted = -(-need // there) - skip
            if len(dst) != wanted:
                raise InvalidArgumentError(
                    f"request {request_id!r}: {need} tokens from block {skip} on are {wanted} "
                    f"destination blocks, got {len(dst)}"
                )
            request.claim(
                dest,
                dest.epoch,
                dst,
                (slot, generation, layerwise),
                (need, skip, planner.unit_tokens, planner.units),
            )
            watch = dest not in self._watched
            self._watched.add(dest)
        if watch:
            self._clock.after(PEER_CHECK_S, lambda: self._check_peer(dest))
        self._clock.after(deadline_s, lambda: self._ticket_expired(request, deadline_s))
        self._send_ready(request)

    @staticmethod
    def _ticket(request_id: str, dest: Destination, ticket) -> tuple[int, int, bool, float]:
        """(slot, generation, layerwise, timeout) of `ticket`, checked to be the one
        `dest`'s receiver issued for `request_id`."""
        if not isinstance(ticket, dict):
            raise InvalidArgumentError(f"ticket must be the receiver's expect(), got {ticket!r}")
        if ticket.get("request") != request_id:
            raise InvalidArgumentError(
                f"the ticket is for request {ticket.get('request')!r}, not {request_id!r}: "
                f"pass the ticket its decode side's expect({request_id!r}) returned"
            )
        if ticket.get("receiver") != dest.receiver:
            raise InvalidArgumentError(
                f"the ticket for {request_id!r} comes from another receiver than the one dest "
                f"was connected to ({ticket.get('receiver')!r}, not {dest.receiver!r})"
            )
        slot = checks.integer(ticket.get("slot"), "the ticket's slot", 0, dest.status_slots - 1)
        generation = checks.integer(
            ticket.get("generation"), "the ticket's generation", 1, GENERATIONS
        )
        layerwise = checks.flag(ticket.get("layerwise", False), "the ticket's layerwise")
        if "timeout" not in ticket:
            raise InvalidArgumentError(
                "the ticket has no timeout: pass the receiver's expect() unchanged (the "
                "prefill side ends a request by its decode side's deadline)"
            )
        timeout = checks.seconds(ticket["timeout"], "the ticket's timeout")
        return slot, generation, layerwise, timeout

    def _live(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None or not request.live:
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
        what became ready (requests not added, or ended, are passed over). `signal_ns`:
        when the engine signalled the layer (time.monotonic_ns() in this process; now if
        not given), from which the overlap numbers are measured; `step`: the engine's step,
        kept in the layer's metrics record."""
        signal_ns = (
            time.monotonic_ns()
            if signal_ns is None
            else checks.integer(signal_ns, "signal_ns", 0, checks.LATEST_NS)
        )
        self._open()
        if step is not None:
            step = checks.integer(step, "step")
        layer = checks.integer(layer, "layer", 0, self.layout.num_layers - 1)
        self._take(layer, self._ready_entries(ready), signal_ns, step)

    def follow(self, signals: ProgressReader, step: int, ready) -> None:
        """Send every layer of `ready` ((request_id, tokens in the cache), as layer_ready
        takes) of engine step `step` as the engine signals it on `signals` (the messager's
        ProgressReader of the per-query channel), with no call per layer: each layer's
        copies wait on the link for that layer's signal and start at it, with no Python in
        between (a transport whose links gate: Transport.gates, shm's), and apart from the
        link's other writes, which never wait behind them. One call per step, in the steps'
        order, before or while its layers are signalled (a layer signalled already goes at
        once); as the feeds do, it takes a later step's signal to mean every layer of the
        earlier ones was signalled (the protocol's layers come in order). A layer not
        signalled within stall_timeout of the link reaching it is never copied: its
        requests fail, told why. A followed request that fails before its signals came
        (fail, abort, its decode side's deadline) gives up its layers no live request
        shares.

        Each request must be streaming (its destination set): call layer_ready for the
        others. A layerwise ticket hears each layer once it landed, as with layer_ready.
        Requests not added, or ended, are passed over. InvalidArgumentError for anything
        else, before anything is sent."""
        self._open()
        if not self._transport.gates:
            raise InvalidArgumentError(
                f"follow() needs a transport whose links wait for a signal themselves "
                f"(Transport.gates); {self._transport.name!r}'s do not: call layer_ready per "
                f"signal"
            )
        if self._staging is not None:
            raise InvalidArgumentError(
                "follow() cannot stage: these caches are copied into pinned host memory "
                "layer by layer on the caller's thread; call layer_ready per signal"
            )
        if not isinstance(signals, ProgressReader):
            raise InvalidArgumentError(
                f"signals must be the per-query channel's ProgressReader "
                f"(pdhal.ops.open_kv_signal_reader), got {signals!r}"
            )
        segment = signals.segment.dup()  # ClosedHandleError once it was closed; then the
        # gates read their signals whether or not the reader is closed meanwhile
        step = checks.integer(step, "step", 1, MAX_STEP)
        entries = self._ready_entries(ready)
        channel = _channel(segment)
        with self._following:
            self._follow(segment, channel, step, entries)

    def last_followed(self, signals: ProgressReader) -> int:
        """The last step follow() took on `signals`' channel (0: none); a producer that
        restarted makes its channel anew, whose steps count from 1 again."""
        with self._lock:
            return self._followed.get(_channel(signals.segment), 0)

    def _follow(self, segment, channel: tuple[str, int], step: int, entries) -> None:
        """follow()'s checks of the step and its requests, then its layers (one at a time)."""
        with self._lock:
            latest = self._followed.get(channel, 0)
            if step < latest:  # its gates would wait behind the later step's on each link
                raise InvalidArgumentError(
                    f"step {step} is followed after step {latest} of {segment.path}: follow "
                    f"a channel's steps in order (a layer waits on its link behind the gates "
                    f"queued before it)"
                )
            for request_id, _ in entries:
                request = self._requests.get(request_id)
                if request is None or not request.live:
                    continue
                if request.state is not State.STREAMING:
                    raise InvalidArgumentError(
                        f"request {request_id!r} has no decode side yet: follow() sends "
                        f"only requests whose destination is set; call layer_ready for it"
                    )
            self._followed[channel] = step
        for layer in range(self.layout.num_layers):
            until = (step << _core.LAYER_BITS) | (layer + 1)
            gate = Gate(segment, until, self.stall_timeout)
            self._take(layer, entries, 0, step, gate)

    def _take(
        self,
        layer: int,
        entries: list[tuple[str, int]],
        signal_ns: int,
        step: int | None,
        gate: Gate | None = None,
    ) -> None:
        """`entries` ((request_id, tokens)) are ready in `layer`: send what became
        sendable (behind `gate`, when followed)."""
        by_dest: dict[int, tuple[Destination, list[Request]]] = {}
        lease: list[Request] = []
        with self._lock:
            for request_id, tokens in entries:
                request = self._requests.get(request_id)
                if request is None or not request.live:
                    continue  # ended (failed) already: its later layers go nowhere
                missing = request.sources_missing
                request.ready[layer] = max(request.ready[layer], tokens)
                if layer == request.layers - 1 and tokens >= request.prompt_tokens:
                    request.last_signal_ns = signal_ns
                if not missing and request.sources_missing:
                    lease.append(request)
                if gate is not None:
                    request.follows[layer] = gate
                if (
                    request.state is State.STREAMING
                    and request.sendable(layer) > request.sent[layer]
                ):
                    by_dest.setdefault(id(request.dest), (request.dest, []))[1].append(request)
        for request in lease:
            self._clock.after(self.claim_timeout, lambda r=request: self._sources_expired(r))
        for dest, requests in by_dest.values():
            self._send(dest, layer, requests, signal_ns, step, gate)

    @staticmethod
    def _ready_entries(ready) -> list[tuple[str, int]]:
        if isinstance(ready, (str, bytes, dict)) or not hasattr(ready, "__iter__"):
            raise InvalidArgumentError(f"ready must be (request_id, tokens) pairs, got {ready!r}")
        entries = []
        for index, entry in enumerate(ready):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise InvalidArgumentError(
                    f"ready must be (request_id, tokens) pairs; ready[{index}] is {entry!r}"
                )
            request_id = checks.name(entry[0], f"ready[{index}]'s request_id")
            entries.append((request_id, checks.integer(entry[1], f"ready[{index}]'s tokens")))
        return entries

    def _send_ready(self, request: Request) -> None:
        """Send what of `request` is sendable and was not sent, layer by layer: behind the
        gate of the layer's last follow, unless its signal came (its tokens are ready only
        once it comes)."""
        with self._lock:
            if request.state is not State.STREAMING:
                return
            layers = [
                (layer, request.follows[layer])
                for layer in range(request.layers)
                if request.sendable(layer) > request.sent[layer]
            ]
        now = time.monotonic_ns()
        for layer, gate in layers:
            if gate is None or gate.came():
                self._send(request.dest, layer, [request], now)
            else:
                self._send(request.dest, layer, [request], 0, gate.until >> _core.LAYER_BITS, gate)

    def _send(
        self,
        dest: Destination,
        layer: int,
        requests: list[Request],
        signal_ns: int,
        step: int | None = None,
        gate: Gate | None = None,
    ) -> None:
        """Hand `dest` the newly sendable blocks of `requests` in `layer` (behind `gate`)."""
        with self._lock:
            spans, items = [], []
            for request in requests:
                first, end = request.sent[layer], request.sendable(layer)
                if end <= first or request.state is not State.STREAMING:
                    continue
                spans.append((request, first, end))
                items.append((request, end - first))
                request.mark_sent(layer, end)
                if gate is not None:
                    request.gates.append(gate)
            if not items:
                return
            key = (dest, tuple(spans))  # every layer of a step sends the same spans
            runs = self._plans.get(key)
        if runs is None:  # ids checked when the request and its destination came
            joined: list[list[int]] = []
            for request, first, end in spans:
                for src, dst, count in request.runs(first, end):
                    extend_runs(joined, src, dst, count)
            runs = BlockRuns([tuple(run) for run in joined])
            with self._lock:
                if len(self._plans) >= PLANS:
                    self._plans.clear()
                self._plans[key] = runs
        blocks = sum(n for _, n in items)
        nbytes = dest.planner.block_bytes[layer] * blocks
        send = Send(
            layer=layer,
            items=items,
            runs=runs,
            nbytes=nbytes,
            signal_ns=signal_ns,
            step=step,
            gate=gate,
        )
        failure = self._stage(layer, spans) if self._staging is not None else None
        if failure is None:
            if gate is None:
                dest.put(send)
            else:
                dest.arm(send)
            return
        with self._lock:  # nothing of it went: each request fails, its decode side told
            acts = []
            for request, _ in items:
                request.write_failed_alone(failure)
                acts.append((request, request.advance()))
        for request, action in acts:
            self._act(request, action)

    def _stage(self, layer: int, spans: list[tuple[Request, int, int]]) -> str | None:
        """Copy the blocks of `spans` in `layer` from the caches into their pinned host
        mirror, which the transport sends from: None once done, else why it failed."""
        blocks = [b for request, first, end in spans for b in request.source_blocks(first, end)]
        try:
            self._staging.to_mirror(blocks, range(layer, layer + 1))
        except PdhalError as exc:
            return f"copying its blocks from the caches into pinned host memory failed: {exc}"
        return None

    # ---- what the destinations report --------------------------------------------

    def _write_settled(self, dest: Destination, write: Write, reason: str | None) -> None:
        """A destination's write landed (reason None), failed, or was dropped unsent (""):
        its requests move on. On one of that destination's threads."""
        if isinstance(write, Send):
            self._send_settled(dest, write, reason)
        elif write.action is None:  # a layerwise progress word
            with self._lock:
                write.request.write_settled(None, 0, 0, _failure(reason))
                action = write.request.advance()
            self._act(write.request, action)
        elif reason is None and write.then is not None:  # the reason landed: now its word
            dest.put(StatusWrite(request=write.request, data=write.then, action=write.action))
        else:
            with self._lock:
                final = write.request.posted(write.action, _failure(reason))
            self._report(write.request, final)

    def _send_settled(self, dest: Destination, send: Send, reason: str | None) -> None:
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
        acts, progress = [], []
        with self._lock:
            for request, blocks in send.items:
                if request.first_submit_ns is None and send.submit_ns:
                    request.first_submit_ns = send.submit_ns
                if send.gate is not None:
                    request.gates.remove(send.gate)
                    if send.layer == request.layers - 1:
                        # when the link saw it (a later chunk's last layer settles later)
                        request.last_signal_ns = send.signal_ns
                why = reason or (
                    "the streamer stopped sending to this decode side" if reason == "" else None
                )
                if send.link_sound:  # its decode side is told why
                    request.write_failed_alone(why)
                elif request.write_settled(send.layer, blocks, per_block * blocks, why):
                    request.in_flight += 1  # the progress word, settled like a layer
                    progress.append((request, request.layers_landed))
                acts.append((request, request.advance()))
        for request, layers in progress:
            dest.put(
                StatusWrite(
                    request=request,
                    at=mailbox.PROGRESS_AT,
                    data=mailbox.progress(request.generation, layers),
                )
            )
        for request, action in acts:
            self._act(request, action)

    def _broken(self, dest: Destination, epoch: int, reason: str) -> None:
        """`dest`'s link broke: every request sent there before `epoch` fails, its decode
        side ending it by its own deadline (the link that would tell it is gone)."""
        with self._lock:
            acts = []
            for request in self._requests.values():
                if request.dest is dest and request.epoch < epoch:
                    request.fail(reason, post=False)
                    acts.append((request, request.advance()))
        for request, action in acts:
            self._act(request, action)

    def _act(self, request: Request, action: Action | None) -> None:
        """Carry out what `request`'s last transition asked for (outside the lock). One
        that failed with followed layers still waiting for their signals gives up those no
        live request needs: its outcome is not held up by signals that may never come."""
        if request.gates and not request.live:
            request.dest.give_up_unneeded()
        if action is None:
            return
        if not action.post:
            self._report(request, action)
            return
        word = mailbox.word(request.generation, mailbox.LANDED if action.landed else mailbox.FAILED)
        if action.landed:
            request.dest.put(StatusWrite(request=request, data=word, action=action))
        else:  # the reason first, its word once the reason landed
            reason = mailbox.reason_bytes(request.generation, action.reason)
            request.dest.put(
                StatusWrite(
                    request=request, at=mailbox.REASON_AT, data=reason, action=action, then=word
                )
            )

    def _report(self, request: Request, action: Action) -> None:
        """`request` ended: its numbers are kept and its outcome goes out."""
        self.metrics.request(
            action.landed,
            request.nbytes,
            request.first_submit_ns,
            request.last_signal_ns,
            time.monotonic_ns(),
            request.id,
        )
        outcome = Outcome(request.id, action.landed, action.reason)
        with self._lock:
            if self._requests.get(request.id) is request:
                del self._requests[request.id]
            if self._on_outcome is None:
                self._outcomes.put(outcome)
        if self._on_outcome is not None:
            try:
                self._on_outcome(outcome)
            except Exception:
                log.exception("pdhal.transfer: on_outcome raised for %s", outcome)

    # ---- failures, leases and peers -------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` was added and has not ended (it will be reported: a failed
        one once its writes settled)."""
        with self._lock:
            request = self._requests.get(request_id) if isinstance(request_id, str) else None
            return request is not None and not request.ended

    def fail(self, request_id: str, reason: str) -> None:
        """End `request_id` as failed with `reason`, on both sides (the decode side reads it
        in its status slot, or by its deadline if the link is gone), once nothing of it is
        in flight any more. A request that ended, or whose outcome is already going out,
        is left as it is."""
        request_id = checks.name(request_id, "request_id")
        reason = checks.name(str(reason), "reason")
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or not request.fail(reason):
                return
            action = request.advance()
        self._act(request, action)

    def abort(self, reason: str) -> None:
        """Fail every request that still needs something of the prefill side (e.g. its
        worker died): those not ended, but for those every block of which was handed to its
        decode side already (a followed layer, once the engine signalled it), which land
        (or fail) as their writes settle."""
        reason = checks.name(str(reason), "reason")
        with self._lock:
            acts = [
                (r, r.advance())
                for r in list(self._requests.values())
                if not r.all_sent and r.fail(reason)
            ]
        for request, action in acts:
            self._act(request, action)

    def _claim_expired(self, request: Request) -> None:
        with self._lock:
            if request.state is not State.ADDED or not request.fail(
                f"no decode side claimed it within {self.claim_timeout:g} s"
            ):
                return
            action = request.advance()
        self._act(request, action)

    def _sources_expired(self, request: Request) -> None:
        with self._lock:
            if not request.sources_missing or not request.fail(
                f"its prompt was whole but not all its source blocks were given (add_blocks) "
                f"within {self.claim_timeout:g} s"
            ):
                return
            action = request.advance()
        self._act(request, action)

    def _ticket_expired(self, request: Request, timeout: float) -> None:
        """The decode side gave `request` up by now: end it, writing nothing more of it but
        its FAILED word, which tells the decode side its blocks are free again."""
        with self._lock:
            if not request.fail(f"its decode side's deadline ({timeout:g} s) passed"):
                return
            action = request.advance()
        self._act(request, action)

    def _check_peer(self, dest: Destination) -> None:
        """While `dest` has requests, look at its liveness every PEER_CHECK_S; a gone one
        fails them and, once it has none, is forgotten."""
        why = dest.gone or dest.problem()
        if why is not None and dest.gone is None:
            dest.gone = why
            dest.break_(why)
        with self._lock:
            users = any(r.dest is dest and not r.ended for r in self._requests.values())
            if not users:
                self._watched.discard(dest)
                if why is not None:
                    keys = [k for k, d in self._destinations.items() if d is dest]
                    for key in keys:
                        del self._destinations[key]
        if users:
            self._clock.after(PEER_CHECK_S, lambda: self._check_peer(dest))
        elif why is not None:
            dest.stop(time.monotonic())  # its threads end on their own once idle

    # ---- reporting ------------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> list[Outcome]:
        """The requests that ended since the last poll (the prefill side may free the
        blocks of each), waiting up to `timeout` seconds for one if none has. Leases and
        peers are kept without it."""
        return self._outcomes.take(timeout)

    def pending(self) -> int:
        """Requests not reported yet."""
        with self._lock:
            return len(self._requests)

    def close(self) -> None:
        """Fail every request that still needs something of the prefill side (abort), let
        those wholly sent settle, tell each decode side (each write bounded by
        stall_timeout), and close every link: within 2 x stall_timeout (+1 s), after which
        what is left is reported failed without telling its decode side."""
        with self._lock:
            destinations = list(dict.fromkeys(self._destinations.values()))
        if self._clock.runs_here() or any(d.runs_here() for d in destinations):
            raise InvalidArgumentError(
                "close() from one of the streamer's own threads (an on_outcome callback?) "
                "would wait for itself: close it from another thread"
            )
        with self._lock:
            if self._closed:
                return
            self._closed = True
            destinations = list(dict.fromkeys(self._destinations.values()))
        self._clock.close()
        self.abort("the streamer was closed")
        deadline = time.monotonic() + 2 * self.stall_timeout + 1.0
        for dest in destinations:
            if not dest.stop(deadline):
                log.warning("pdhal.transfer: a decode side did not settle by close()'s bound")
        with self._lock:
            self._destinations.clear()
            acts = [(r, r.abandon("the streamer was closed")) for r in self._requests.values()]
        for request, action in acts:
            self._act(request, action)
        self._unpin()
        if self._staging is not None:
            self._staging.close()  # (a free waits for the copies its links queued)


def _failure(reason: str | None) -> str | None:
    """A write's settling as a request hears it: None (landed), or why it did not."""
    if reason == "":
        return "the streamer dropped a write of it (its decode side broke)"
    return reason
