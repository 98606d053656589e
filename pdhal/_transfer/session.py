"""The control plane of layer-wise transfers, as library API: a prefill-side service per
prefill rank, and a decode-side client per decode rank, in a typed, versioned session
(pdhal._transfer.messages; docs/session-protocol.md).

    # prefill rank r of P (what a cache messager runs)
    service = transfer.PrefillService(layout, block_tokens=64, key=KEY, kv_heads=8,
                                      tp_rank=r, tp_size=P, listen=f"0.0.0.0:{port0 + r}")
    service.add_request("req-1", src_blocks, prompt_tokens)   # from the scheduler's table
    service.layer_ready(layer, [("req-1", tokens)])            # on each layer signal
    service.poll()  # or on_outcome=: each request once, when every decode rank's part ended

    # decode rank d of D
    client = transfer.DecodeClient(receiver, key=KEY, kv_heads=8, block_tokens=64,
                                   tp_rank=d, tp_size=D)
    client.claim("req-1", prefill="host:port0", blocks=my_blocks, tokens=n, timeout=30)
    client.poll()   # each request once: landed when every prefill rank's part landed

The hello checks everything once (protocol version, transport and its version, namespace,
KV heads and both tensor-parallel splits, each layer's cache layout and element type, the
key) and refuses a mismatch naming both sides. The two sides' blocks may hold different
numbers of tokens: each token of each head goes where the decode side's block holds it. A
request's KV comes to decode rank d from each
prefill rank holding heads it needs (pdhal.transfer.head_shards) as a part of its own: a
receiver request named part_id(request, prefill rank, d), claimed from that rank's service.
Each side keeps the other alive with pings (`keepalive`: a silent or cut link is an error
within it); a link that ends fails the parts on it, and a client reconnects at its next
claim (a restarted service is served again). Every timer is a deadline on one clock.

No write after give-up: a part the service never wrote is answered Unserved, so its blocks
are free at once; a part whose link went stays held (KVReceiver.freed()) until its prefill
side's end arrives, or a restarted service at that address shows the old one is gone."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pdhal._errors import (
    ClosedHandleError,
    InvalidArgumentError,
    PdhalError,
    RefusedError,
    SessionError,
)
from pdhal._protocol.names import namespace
from pdhal._transfer import checks, control, messages
from pdhal._transfer.heads import head_shards, rank_heads
from pdhal._transfer.keeper import Clock, Deadlines
from pdhal._transfer.layout import CacheLayout
from pdhal._transfer.outcome import Outcome, Outcomes
from pdhal._transfer.plugins import transport
from pdhal._transfer.receiver import KVReceiver
from pdhal._transfer.streamer import KVStreamer

#: How long a hello (or the service's welcome) may take once connected.
HANDSHAKE_S = 10.0
#: What wakes the service's thread to deliver the outcomes queued.
_WAKE = "wake"
#: Claims one decode rank may have waiting for their requests, at most.
MOST_WAITING = 4096
#: Requests whose decode side gave them up (cancelled, or its session ended) before the
#: engine added them, remembered (the latest) so that one added afterwards fails at once
#: instead of holding its blocks for the claim lease.
ABANDONED_KEPT = 4096
#: Requests that ended (or that the engine failed before adding them), remembered (the
#: latest) so that a claim coming after is answered at once, not at its claim lease.
ENDED_KEPT = 4096
#: After a lost session, when (s, one after the other) its address is probed: one that
#: refuses shows its service is gone (DecodeClient._gone).
PROBES_S = (0.0, 0.1)

log = logging.getLogger("pdhal")


def _ready_pairs(ready) -> list[tuple[str, int]]:
    """`ready` ((request_id, tokens) pairs, as layer_ready takes), checked whole."""
    if isinstance(ready, (str, bytes)) or not hasattr(ready, "__iter__"):
        raise InvalidArgumentError(f"ready must be a list of (request_id, tokens), got {ready!r}")
    pairs = []
    for index, pair in enumerate(ready):  # all checked before any is given
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgumentError(f"ready[{index}] must be (request_id, tokens)")
        request_id = checks.name(pair[0], f"ready[{index}]'s request_id")
        pairs.append((request_id, checks.integer(pair[1], f"ready[{index}]'s tokens", 1)))
    return pairs


def part_id(request_id: str, prefill_rank: int, decode_rank: int) -> str:
    """The name of the part of `request_id` prefill rank `prefill_rank` sends decode rank
    `decode_rank` (the receiver request it lands as, on both sides)."""
    return f"{request_id}@{prefill_rank}>{decode_rank}"


def request_of(part: str) -> str:
    """The request a part_id() names (a request id may itself hold "@")."""
    return checks.name(part, "part").rpartition("@")[0]


def rank_address(rank0: str, rank: int) -> str:
    """The service of prefill rank `rank`: the ranks of an instance listen on ports in a row
    from rank 0's, which is the one address a decode side is told."""
    host, port = control.parse_address(rank0, "the prefill address")
    return f"{host}:{port + rank}"


def _bounded(text: str) -> str:
    """`text` cut to what a message's string may hold (a reason naming a long id)."""
    most = messages.MOST_CHARS
    return text if len(text) <= most else text[: most - 3] + "..."


def _facts(
    role: str,
    transport_name: str,
    block_tokens: int,
    kv_heads: int,
    tp_rank: int,
    tp_size: int,
    keepalive: float,
) -> messages.Facts:
    return messages.Facts(
        role=role,
        instance=uuid.uuid4().hex,
        pid=os.getpid(),
        host=socket.gethostname(),
        transport=transport_name,
        transport_version=getattr(transport(transport_name), "version", ""),
        namespace=namespace(),
        block_tokens=block_tokens,
        kv_heads=kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        keepalive=keepalive,
    )


def _split(layout: CacheLayout, kv_heads: object, tp_rank: object, tp_size: object) -> tuple:
    """(kv_heads, tp_rank, tp_size) checked, and against `layout`: every cache holds the
    rank's share of the heads. kv_heads None: the layout's heads times tp_size."""
    size = checks.integer(tp_size, "tp_size", 1, 1 << 16)
    rank = checks.integer(tp_rank, "tp_rank", 0, size - 1)
    if kv_heads is None:
        kv_heads = layout.layers[0][0].heads * size
    heads = checks.integer(kv_heads, "kv_heads", 1, 1 << 16)
    held = len(rank_heads(heads, size, rank))
    for layer, caches in enumerate(layout.layers):
        for index, spec in enumerate(caches):
            if spec.heads != held:
                raise InvalidArgumentError(
                    f"layer {layer} cache {index} holds {spec.heads} KV head(s); rank {rank} "
                    f"of {size} holds {held} of {heads} (give each CacheSpec its heads)"
                )
    return heads, rank, size


def mismatch(
    prefill: messages.Facts, decode: messages.Facts, same_block_size: bool = False
) -> str | None:
    """Why these two sides cannot pair (naming both), or None. `same_block_size`: blocks
    of two sizes do not pair either."""
    checked = [
        ("transport", "transport"),
        ("transport version", "transport_version"),
        ("namespace", "namespace"),
        ("KV heads", "kv_heads"),
    ]
    if same_block_size:
        checked.append(("block size (tokens)", "block_tokens"))
    differ = [
        (what, getattr(prefill, name), getattr(decode, name))
        for what, name in checked
        if getattr(prefill, name) != getattr(decode, name)
    ]
    if not differ:
        return None
    said = "; ".join(f"{what}: {p!r} here, {d!r} there" for what, p, d in differ)
    return f"{prefill.named()} and {decode.named()} cannot pair: {said}"


# ---- the prefill side ---------------------------------------------------------------------


@dataclass(eq=False)
class _Client:
    """A decode rank connected to this service."""

    facts: messages.Facts
    link: control.ControlLink | None = None
    dest: object = None  # the streamer's Destination for it
    parts: set[str] = field(default_factory=set)  # claimed here, not ended


@dataclass(eq=False)
class _Served:
    """A request of the engine's on this prefill rank: its source, the tokens ready per
    layer, and its parts (one per decode rank it sends heads to, made as each claims)."""

    request_id: str
    src_blocks: list[int]
    prompt_tokens: int
    ready: list[int]
    #: each layer's last layer_ready (signal_ns, step), for a part claimed after it
    given: list[tuple[int | None, int | None]] = field(default_factory=list)
    #: its last follow() (signals, step, tokens), for a part claimed after it
    followed: tuple[object, int, int] | None = None
    parts: dict[str, _Client] = field(default_factory=dict)  # part -> its decode rank
    cached: dict[str, int] = field(default_factory=dict)  # part -> prompt blocks not sent
    expected: int | None = None  # parts its decode instance needs, once one claimed
    ended: dict[str, str] = field(default_factory=dict)  # part -> "" landed, else why
    failure: str | None = None  # failed as a whole (claim lease, fail(), abort())


class PrefillService:
    """Serves one prefill rank's KV to the decode ranks that claim it: a KVStreamer, and
    the sessions of the decode ranks connected at `address`.

    Thread-safe. The engine adds its requests (add_request, add_blocks) and says what each
    layer holds (layer_ready, which PerQueryFeed / PerChunkFeed drive as they drive a
    streamer); each request ends once, landed when every decode rank it has landed, and
    goes to `on_outcome` (on the service's thread; quick, may call the service) or to
    poll(). A request no decode side claims within `claim_timeout` s fails.
    `on_session_end(facts, reason)`: a decode rank's session ended (its parts failed); on
    that session's thread, quick (a decode process killed outright cannot remove its
    segments: the engine may look for them, pdhal.cleanup). `clock`: what its leases are
    read on (a test's ManualClock). `same_block_size`: refuse a decode rank whose blocks
    hold another number of tokens, at its hello (for caches whose token order inside a
    block the layout does not say; else each token goes where the decode side's block
    holds it). `streamer_options` go to the KVStreamer (max_layers_in_flight,
    stall_timeout)."""

    def __init__(
        self,
        layout: CacheLayout,
        block_tokens: int,
        *,
        key: bytes,
        kv_heads: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        listen: str = "127.0.0.1:0",
        keepalive: float = 5.0,
        claim_timeout: float = 60.0,
        transport_name: str = "shm",
        on_outcome: Callable[[Outcome], None] | None = None,
        on_session_end: Callable[[messages.Facts, str], None] | None = None,
        clock: Clock | None = None,
        same_block_size: bool = False,
        **streamer_options,
    ):
        if not isinstance(layout, CacheLayout):
            raise InvalidArgumentError(f"layout must be a CacheLayout, got {layout!r}")
        if not isinstance(key, bytes) or not key:
            raise InvalidArgumentError("key must be non-empty bytes (the deployment's secret)")
        heads, rank, size = _split(layout, kv_heads, tp_rank, tp_size)
        self.keepalive = messages.keepalive(keepalive, "keepalive")
        self.claim_timeout = checks.seconds(claim_timeout, "claim_timeout")
        for name, hook in (("on_outcome", on_outcome), ("on_session_end", on_session_end)):
            if hook is not None and not callable(hook):
                raise InvalidArgumentError(f"{name} must be callable, got {hook!r}")
        bind = control.parse_address(listen, "listen")
        self._key = key
        self._same_block_size = checks.flag(same_block_size, "same_block_size")
        self._on_outcome = on_outcome
        self._on_session_end = on_session_end
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # parts' outcomes, in order
        self.streamer = KVStreamer(
            layout,
            block_tokens,
            transport_name=transport_name,
            claim_timeout=self.claim_timeout,
            on_outcome=self._events.put,
            clock=clock,
            **streamer_options,
        )
        self.layout = layout
        self.facts = _facts(
            "prefill",
            transport_name,
            self.streamer.block_tokens,
            heads,
            rank,
            size,
            self.keepalive,
        )
        #: whether this rank holds a KV head no earlier rank holds: one that does not (its
        #: heads replicated there) sends nothing, whatever a decode side's split
        self.sends = any(src == rank for src, _ in head_shards(heads, size, 1))
        self._lock = threading.Lock()
        self._served: dict[str, _Served] = {}
        self._owner: dict[str, _Served] = {}  # part -> its request
        #: claims (and Cached) that came before their request
        self._claims: dict[str, tuple[_Client, messages.Claim | messages.Cached]] = {}
        self._abandoned: collections.OrderedDict[str, str] = collections.OrderedDict()  # why
        #: request -> why it failed, "" if it landed (ENDED_KEPT of them)
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: a decode instance's claims its lost session left waiting, by its instance id
        self._dropped: dict[str, list[str]] = {}
        self._clients: set[_Client] = set()
        self._outcomes = Outcomes()
        self._closed = False
        self._clock = Deadlines("pdhal-session-clock", clock)
        try:
            self._listener = socket.create_server(bind)
        except OSError as e:
            self._clock.close()
            self.streamer.close()
            raise SessionError(f"cannot listen on {listen}: {e}") from None
        host = bind[0] if bind[0] not in ("", "0.0.0.0", "::") else socket.gethostname()
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        for target, name in ((self._accept, "accept"), (self._settle, "outcomes")):
            threading.Thread(target=target, name=f"pdhal-session-{name}", daemon=True).start()

    # ---- the engine's side ----------------------------------------------------------

    def add_request(self, request_id: str, src_blocks, prompt_tokens: int) -> None:
        """A request whose KV is (or will be) in `src_blocks` of this rank's caches, its
        prompt `prompt_tokens` long (add_blocks gives more blocks of a chunked prompt). On
        a rank that sends nothing (`sends` False) it lands at once."""
        request_id = checks.name(request_id, "request_id")
        tokens = checks.integer(prompt_tokens, "prompt_tokens", 1)
        src = checks.block_ids(src_blocks, "src_blocks", self.layout.num_blocks, "prefill caches")
        if len(src) > -(-tokens // self.streamer.block_tokens):
            raise InvalidArgumentError(
                f"request {request_id!r}: {len(src)} source blocks for {tokens} tokens"
            )
        with self._lock:
            self._open()
            if request_id in self._served:
                raise InvalidArgumentError(f"request {request_id!r} was added already")
            layers = self.layout.num_layers
            served = _Served(request_id, src, tokens, [0] * layers, [(None, None)] * layers)
            if not self.sends:  # no decode side claims it here
                self._abandoned.pop(request_id, None)
                self._remember_ended(request_id, "")
                self._outcomes.put(Outcome(request_id, True))
                self._deliver()
                return
            self._served[request_id] = served
            self._ended.pop(request_id, None)  # (an id used again)
            waiting = [p for p, (_, c) in self._claims.items() if c.request == request_id]
            for part in waiting:
                client, claim = self._claims.pop(part)
                self._claim(served, client, claim)
            abandoned = self._abandoned.pop(request_id, None)
            if abandoned is not None and not waiting:  # (another decode side's claim wins)
                self._fail(served, abandoned)
        self._deliver()
        self._clock.after(self.claim_timeout, lambda: self._lease(served))

    def add_blocks(self, request_id: str, src_blocks) -> None:
        """More source blocks of `request_id`, after those it has."""
        request_id = checks.name(request_id, "request_id")
        src = checks.block_ids(src_blocks, "src_blocks", self.layout.num_blocks, "prefill caches")
        with self._lock:
            served = self._live(request_id)
            if len(served.src_blocks) + len(src) > -(
                -served.prompt_tokens // self.streamer.block_tokens
            ):
                raise InvalidArgumentError(
                    f"request {request_id!r}: more source blocks than its "
                    f"{served.prompt_tokens} tokens fill"
                )
            had = len(served.src_blocks)
            served.src_blocks += src
            for part in self._streaming(served):
                with contextlib.suppress(InvalidArgumentError):  # it ended meanwhile
                    self.streamer.add_blocks(part, src[max(0, served.cached[part] - had) :])

    def layer_ready(
        self, layer: int, ready, signal_ns: int | None = None, *, step: int | None = None
    ) -> None:
        """Layer `layer` now holds `tokens` of each (request_id, tokens) in `ready`."""
        layer = checks.integer(layer, "layer", 0, self.layout.num_layers - 1)
        pairs = _ready_pairs(ready)
        with self._lock:  # (the streamer never calls back into it: its outcomes queue)
            known = self._known(pairs)
            given = [(part, tokens) for served, tokens in known for part in self._streaming(served)]
            self.streamer.layer_ready(layer, given, signal_ns, step=step)  # refuses bad input
            for served, tokens in known:  # kept for parts claimed later
                served.ready[layer] = max(served.ready[layer], tokens)
                served.given[layer] = (signal_ns, step)

    def follow(self, signals, step: int, ready) -> None:
        """Send every layer of `ready` ((request_id, tokens), as layer_ready takes) of
        engine step `step` as the engine signals it on `signals` (the messager's
        ProgressReader of the per-query channel): one call per step and none per layer, each
        layer's copies waiting on the link for its signal (KVStreamer.follow). A part claimed
        later is followed from its claim, a layer signalled by then going at once. Refused
        as KVStreamer.follow refuses (a transport that does not gate, staged caches, a
        reader that is not one, a step out of range), before anything is sent."""
        pairs = _ready_pairs(ready)
        with self._lock:
            known = self._known(pairs)
            given = [(part, tokens) for served, tokens in known for part in self._streaming(served)]
            self.streamer.follow(signals, step, given)  # refuses bad input
            kept = signals.dup()  # parts claimed later, after the messager closed its reader too
            for served, tokens in known:
                served.followed = (kept, step, tokens)

    def _known(self, pairs: list[tuple[str, int]]) -> list[tuple[_Served, int]]:
        """The (request, tokens) of `pairs` whose request is served here (under the lock)."""
        known = [(self._served.get(r), tokens) for r, tokens in pairs]
        return [(served, tokens) for served, tokens in known if served is not None]

    def fail(self, request_id: str, reason: str) -> None:
        """End `request_id` as failed (the engine aborted it): nothing more of it is sent.
        One not added yet fails at once if it is added later, and its claims, those waiting
        and those to come, are answered at once (the decode side frees its blocks)."""
        request_id = checks.name(request_id, "request_id")
        reason = checks.name(str(reason), "reason")
        with self._lock:
            served = self._served.get(request_id)
            if served is not None:
                self._fail(served, reason)
            else:
                self._abandon(request_id, reason)
                self._remember_ended(request_id, reason)
                for part, (client, claim) in list(self._claims.items()):
                    if claim.request == request_id:
                        del self._claims[part]
                        self._unserved(client, part, reason)
        self._deliver()

    def abort(self, reason: str) -> None:
        """The prefill worker died: fail every request that still needs something of it;
        those wholly handed to their decode sides land (or fail) as their writes settle."""
        reason = checks.name(str(reason), "reason")
        self.streamer.abort(reason)
        with self._lock:
            for served in list(self._served.values()):
                if served.expected is None or len(served.parts) < served.expected:
                    self._fail(served, reason)  # a part not claimed yet can never be sent
        self._deliver()

    def poll(self, timeout: float = 0.0) -> list[Outcome]:
        """The requests that ended since the last poll (without on_outcome), waiting up to
        `timeout` seconds for one if none has."""
        return self._outcomes.take(timeout)

    def close(self) -> None:
        """Fail what is not ended (each decode side told: claims waiting for their request
        are unserved, parts get their failure word), then close the streamer and, once its
        writes settled, every session. Returns once each session's last words were written
        (a decode side that reads nothing holds it up to the keepalive bound)."""
        why = "the prefill service was closed"
        with self._lock:
            if self._closed:
                return
            self._closed = True  # (a hello from now on is not welcomed, a claim unserved)
            clients = list(self._clients)
            for served in list(self._served.values()):
                self._fail(served, why)
            for part, (client, _) in self._claims.items():
                self._unserved(client, part, why)
            self._claims.clear()
        self._clock.close()
        self.streamer.close()  # every failure word written (or given up) by its bound...
        links = [client.link for client in clients if client.link is not None]
        for link in links:  # ...before the sessions end: their decode sides heard it
            link.end("the prefill service closed", tell="the prefill service closed")
        for link in links:  # said, not merely queued, by the time close() returns
            link.wait_closed()
        # ...and before a successor can take the address (shut down first: a close alone
        # neither wakes the thread blocked in accept() nor frees the port while it is)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._events.put(None)

    def __enter__(self) -> PrefillService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests and parts (under self._lock) --------------------------------------

    def _open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the prefill service was closed")

    def _live(self, request_id: str) -> _Served:
        self._open()
        served = self._served.get(request_id)
        if served is None:
            raise InvalidArgumentError(f"request {request_id!r} is unknown (or ended)")
        return served

    @staticmethod
    def _streaming(served: _Served) -> list[str]:
        return [p for p in served.parts if p not in served.ended]

    def _claim(
        self, served: _Served, client: _Client, claim: messages.Claim | messages.Cached
    ) -> None:
        """Make part `claim.part` of `served` in the streamer, to `client`'s caches (a
        Cached one: that part landed, nothing to send). A claim
        that cannot be (the part is claimed, the request failed) is answered unserved; one
        the streamer refuses (its blocks, its ticket, a decode side gone) fails the request
        too: nothing else will claim that part."""
        decode = client.facts
        shards = head_shards(self.facts.kv_heads, self.facts.tp_size, decode.tp_size)
        needed = sum(1 for src, _ in shards if src == self.facts.tp_rank)
        why = None
        if served.failure is not None:
            why = served.failure
        elif served.expected is not None and served.expected != needed:
            why = "another decode instance (of another split) claimed it already"
        elif claim.part in served.parts:
            why = "that part was claimed already"
        if why is not None:
            self._unserved(client, claim.part, why)
            return
        if isinstance(claim, messages.Cached):  # nothing to send: that part landed
            served.expected = needed
            served.parts[claim.part] = client
            served.ended[claim.part] = ""
            self._maybe_end(served)
            return
        try:
            if client.dest is None:
                raise InvalidArgumentError(
                    f"decode rank {decode.tp_rank} of {decode.tp_size} gets no KV head from "
                    f"prefill rank {self.facts.tp_rank} of {self.facts.tp_size}"
                )
            # the prefill blocks wholly inside the prefix the decode side has (its blocks
            # may hold another number of tokens)
            skip = claim.cached_blocks * decode.block_tokens // self.facts.block_tokens
            self.streamer.add_request(
                claim.part, served.src_blocks[skip:], served.prompt_tokens, skip
            )
            self.streamer.set_destination(
                claim.part,
                client.dest,
                claim.blocks,
                claim.ticket,
                tokens=claim.tokens,
                cached_blocks=claim.cached_blocks,
            )
        except PdhalError as e:
            why = f"its claim was refused: {e}"
            self.streamer.fail(claim.part, why)  # (added, maybe): it ends unwritten
            self._unserved(client, claim.part, why)
            self._fail(served, why)
            return
        served.expected = needed
        served.parts[claim.part] = client
        served.cached[claim.part] = skip
        self._owner[claim.part] = served
        client.parts.add(claim.part)
        for layer, tokens in enumerate(served.ready):  # what is ready goes now
            if tokens:
                signal_ns, step = served.given[layer]
                self.streamer.layer_ready(layer, [(claim.part, tokens)], signal_ns, step=step)
        if served.followed is not None:  # what its step's signals will make ready
            self._follow_late(served, claim.part)

    def _follow_late(self, served: _Served, part: str) -> None:
        """Part `part` of `served`, claimed after its step was followed: the layers whose
        signal came go now, the others at a signal (of a later step, if one was followed
        since: the streamer follows a channel's steps in order)."""
        signals, step, tokens = served.followed
        try:
            now = signals.current()
            for layer in range(self.layout.num_layers):
                if now >= (step, layer):
                    self.streamer.layer_ready(layer, [(part, tokens)], step=step)
            latest = self.streamer.last_followed(signals)  # (its channel's: a restarted
            self.streamer.follow(signals, max(step, latest), [(part, tokens)])  # worker's anew)
        except PdhalError as e:  # (the streamer closing meanwhile)
            self._fail(served, f"its claim came after its step was followed: {e}")

    def _unserved(self, client: _Client, part: str, reason: str) -> None:
        if client.link is not None:
            client.link.send(messages.Unserved(part, _bounded(reason)))

    def _fail(self, served: _Served, reason: str) -> None:
        if served.failure is None:
            served.failure = reason
        for part in self._streaming(served):
            self.streamer.fail(part, reason)
        self._maybe_end(served)

    def _lease(self, served: _Served) -> None:
        """The claim lease: every part its decode instance needs claimed by now."""
        with self._lock:
            if self._served.get(served.request_id) is not served:
                return
            if served.expected is None or len(served.parts) < served.expected:
                self._fail(served, f"no decode side claimed it within {self.claim_timeout:g} s")
        self._deliver()

    def _maybe_end(self, served: _Served) -> None:
        """`served` ends once no part of it is streaming and either it failed or every part
        its decode instance needs ended: its outcome is queued."""
        if self._streaming(served):
            return
        if served.failure is None and (
            served.expected is None or len(served.ended) < served.expected
        ):
            return  # parts still to be claimed (the claim lease bounds that)
        reasons = [r for r in served.ended.values() if r]
        if served.failure is not None:
            reasons.insert(0, served.failure)
        del self._served[served.request_id]
        for part in served.parts:
            self._owner.pop(part, None)
        why = "; ".join(dict.fromkeys(reasons))
        self._remember_ended(served.request_id, why)
        self._outcomes.put(Outcome(served.request_id, not why, why))

    # ---- threads --------------------------------------------------------------------

    def _settle(self) -> None:
        """The service's thread: the parts' outcomes from the streamer (each request's once
        its parts ended), and every outcome to on_outcome, in order, here only."""
        while True:
            event = self._events.get()
            if isinstance(event, Outcome):
                with self._lock:
                    served = self._owner.get(event.request_id)
                    if served is not None:
                        part = event.request_id
                        served.ended[part] = "" if event.landed else event.reason or "failed"
                        client = served.parts[part]
                        client.parts.discard(part)
                        if client.link is not None:  # its decode side looks at the slot now
                            client.link.send(messages.Ended(part))
                        self._maybe_end(served)
            if self._on_outcome is not None:
                for outcome in self._outcomes.take():
                    try:
                        self._on_outcome(outcome)
                    except Exception:  # the engine's bug must not stop every later outcome
                        log.exception("pdhal.transfer: on_outcome raised for %s", outcome)
            if event is None:
                return

    def _deliver(self) -> None:
        """Wake the service's thread for the outcomes queued (on_outcome runs there)."""
        self._events.put(_WAKE)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError as e:
                if self._closed or self._listener.fileno() < 0:
                    return
                log.warning("pdhal.transfer: accepting a session failed (%s); retrying", e)
                time.sleep(0.1)  # out of descriptors: they come back as sessions end
                continue
            threading.Thread(
                target=self._greet, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True
            ).start()

    def _greet(self, sock: socket.socket, peer: str) -> None:
        """A decode rank's hello: checked, then welcomed (or refused, naming both sides)."""
        why: str | None = None
        try:
            conn = control.accept(sock, self._key, HANDSHAKE_S, peer)
        except SessionError:
            return  # no key, or silent: nothing of it reaches the service
        try:
            hello = control.read_message(conn, HANDSHAKE_S)
            if isinstance(hello, messages.Abandon):
                self._on_abandon(hello)
                with contextlib.suppress(SessionError):
                    welcome = messages.Welcome(messages.PROTOCOL, self.facts)
                    control.write_message(conn, welcome, HANDSHAKE_S)
                conn.close()
                return
            if not isinstance(hello, messages.Hello) or hello.facts.role != "decode":
                raise SessionError(
                    f"the first message must be a decode side's hello, got {hello!r}"
                )
            why = mismatch(self.facts, hello.facts, self._same_block_size)
            if why is None:
                client = _Client(hello.facts)
                try:
                    client.dest = self._connect(hello)
                except PdhalError as e:
                    why = f"{self.facts.named()} and {hello.facts.named()} cannot pair: {e}"
        except SessionError as e:
            why = f"refused: {e}"
        try:
            if why is not None:
                control.write_message(conn, messages.Refused(_bounded(why)), HANDSHAKE_S)
                conn.close()
                return
            control.write_message(
                conn, messages.Welcome(messages.PROTOCOL, self.facts), HANDSHAKE_S
            )
        except SessionError:
            conn.close()
            return
        client.link = control.ControlLink(
            conn,
            keepalive=self.keepalive,
            peer_keepalive=hello.facts.keepalive,
            on_message=lambda m: self._heard(client, m),
            on_lost=lambda why: self._lost(client, why),
            name=f"pdhal-session-decode{hello.facts.tp_rank}",
        )
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._clients.add(client)
            dropped = self._dropped.pop(hello.facts.instance, [])
        client.link.start()
        for part in dropped:  # claims its last session left waiting: none was written
            client.link.send(messages.Unserved(part, "its session ended before its request came"))

    def _connect(self, hello: messages.Hello):
        """The streamer's destination for the decode rank of `hello`: the heads it gets from
        this rank (all of its caches when both splits are the same), layouts checked."""
        decode = hello.facts
        shards = head_shards(self.facts.kv_heads, self.facts.tp_size, decode.tp_size)
        shard = shards.get((self.facts.tp_rank, decode.tp_rank))
        if shard is None:
            return None  # it claims nothing here (rank 0 tells it the split all the same)
        same = decode.tp_size == self.facts.tp_size
        return self.streamer.connect(
            hello.described, heads=None if same else shard, block_tokens=decode.block_tokens
        )

    def _heard(self, client: _Client, message: messages.Message) -> None:
        with self._lock:
            if isinstance(message, (messages.Claim, messages.Cached)):
                self._on_claim(client, message)
            elif isinstance(message, messages.Cancel):
                self._on_cancel(client, message.part)
            else:
                client.link.end(
                    f"the decode side sent a {message.TYPE} mid-session",
                    tell=f"a {message.TYPE} is not a message a decode side sends mid-session",
                )
        self._deliver()

    def _on_claim(self, client: _Client, claim: messages.Claim | messages.Cached) -> None:
        decode = client.facts
        if self._closed:
            self._unserved(client, claim.part, "the prefill service was closed")
            return
        if client.dest is None:
            self._unserved(
                client,
                claim.part,
                f"decode rank {decode.tp_rank} of {decode.tp_size} gets no KV head from "
                f"prefill rank {self.facts.tp_rank} of {self.facts.tp_size}",
            )
            return
        limit = client.dest.planner.dst_blocks
        blocks = claim.blocks if isinstance(claim, messages.Claim) else []
        if len(blocks) > limit or any(b >= limit for b in blocks):
            self._unserved(  # (checked before it may wait: a claim's size is bounded)
                client, claim.part, f"its blocks are not within the decode caches' {limit}"
            )
            return
        expected = part_id(claim.request, self.facts.tp_rank, client.facts.tp_rank)
        if claim.part != expected:
            self._unserved(
                client,
                claim.part,
                f"a claim from decode rank "
                f"{client.facts.tp_rank} to prefill rank {self.facts.tp_rank} "
                f"names part {expected!r}, not {claim.part!r}",
            )
            return
        served = self._served.get(claim.request)
        if served is not None:
            self._claim(served, client, claim)
        elif claim.request in self._ended:  # nothing of it will be sent to this claim
            why = self._ended[claim.request] or "it ended (landed) before this claim"
            self._unserved(client, claim.part, why)
        elif claim.part in self._claims:
            self._unserved(client, claim.part, "that part was claimed already")
        elif sum(1 for owner, _ in self._claims.values() if owner is client) >= MOST_WAITING:
            self._unserved(
                client, claim.part, f"{MOST_WAITING} claims of this decode rank wait already"
            )
        else:  # its table comes later: held for the claim lease
            self._claims[claim.part] = (client, claim)
            self._clock.after(self.claim_timeout, lambda: self._claim_lapsed(claim))

    def _claim_lapsed(self, claim: messages.Claim) -> None:
        with self._lock:
            held = self._claims.get(claim.part)
            if held is None or held[1] is not claim:
                return
            del self._claims[claim.part]
            self._unserved(
                held[0],
                claim.part,
                f"the prefill side did not have request {claim.request!r} within "
                f"{self.claim_timeout:g} s of the claim",
            )

    def _on_cancel(self, client: _Client, part: str) -> None:
        held = self._claims.get(part)
        if held is not None and held[0] is client:
            del self._claims[part]
            self._unserved(client, part, "its decode side cancelled it")
            self._abandon(held[1].request, "its decode side cancelled it")
            return
        if part in client.parts:
            self.streamer.fail(part, "its decode side cancelled it")

    def _on_abandon(self, abandon: messages.Abandon) -> None:
        """A router's word that `abandon.request`'s decode side will never claim it: it
        fails now if no part of it was claimed, or as soon as it is added (unless a decode
        side claimed it by then: a live one wants it after all); a claimed one is its
        decode side's to end (its cancel, its session)."""
        why = f"its decode side will never claim it ({abandon.reason})"
        with self._lock:
            served = self._served.get(abandon.request)
            if served is None:
                if abandon.request not in self._ended:
                    self._abandon(abandon.request, why)
            elif not served.parts:
                self._fail(served, why)
        self._deliver()

    def _remember_ended(self, request_id: str, why: str) -> None:
        self._ended[request_id] = why
        self._ended.move_to_end(request_id)
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def _abandon(self, request_id: str, why: str) -> None:
        """`request_id`, not added yet, fails as soon as it is (under the lock)."""
        self._abandoned[request_id] = why
        while len(self._abandoned) > ABANDONED_KEPT:
            self._abandoned.popitem(last=False)

    def _lost(self, client: _Client, why: str) -> None:
        """A decode rank's session ended: its parts fail (each written nothing more), and
        the requests it claimed that are not here yet fail once they are."""
        with self._lock:
            self._clients.discard(client)
            for part, (owner, claim) in list(self._claims.items()):
                if owner is client:
                    del self._claims[part]
                    self._abandon(claim.request, f"its decode side's session ended: {why}")
                    # told when that decode side comes back: nothing of it was written
                    self._dropped.setdefault(client.facts.instance, []).append(part)
            while len(self._dropped) > ABANDONED_KEPT:
                self._dropped.pop(next(iter(self._dropped)))
            parts = list(client.parts)
        for part in parts:
            self.streamer.fail(part, f"its decode side's session ended: {why}")
        if self._on_session_end is not None:
            try:
                self._on_session_end(client.facts, why)
            except Exception:
                log.exception("pdhal.transfer: on_session_end raised for %s", client.facts)


# ---- a router's word ------------------------------------------------------------------------


def abandon(prefill, request_id: str, reason: str, *, key: bytes, timeout: float = 5.0) -> None:
    """Tell every rank of the prefill instance `prefill` (rank 0's "HOST:PORT", or every
    rank's) that `request_id`'s decode side will never claim it: what a router does when
    the decode request it paired with that prefill failed. Each rank fails the request
    now unless a decode side claimed it, so its blocks are free at once rather than at
    its claim lease. Given rank 0's address alone, the ranks after it are those its
    welcome counts; every rank named is told even if another cannot be. Each step with a
    rank (connecting, the handshake, each message) is bounded by `timeout` s.
    SessionError (RefusedError) naming the first rank that could not be told."""
    instance = _Prefill.parse(prefill)
    request_id = checks.name(request_id, "request_id")
    if len(request_id) > messages.MOST_CHARS:
        raise InvalidArgumentError(
            f"request_id is {len(request_id)} characters, at most {messages.MOST_CHARS}"
        )
    if not isinstance(key, bytes) or not key:
        raise InvalidArgumentError("key must be non-empty bytes (the deployment's secret)")
    timeout = checks.seconds(timeout, "timeout")
    message = messages.Abandon(
        messages.PROTOCOL, request_id, _bounded(checks.name(reason, "reason"))
    )
    if instance.every is not None:
        addresses = list(instance.every)
    else:
        size = _tell(instance.rank0, message, key, timeout).tp_size
        _, port = control.parse_address(instance.rank0)
        if port + size - 1 > 0xFFFF:
            raise SessionError(
                f"the prefill service at {instance.rank0} says its instance has {size} ranks: "
                f"their ports would pass 65535"
            )
        addresses = [rank_address(instance.rank0, rank) for rank in range(1, size)]
    failures = []
    for address in addresses:
        try:
            facts = _tell(address, message, key, timeout)
        except SessionError as e:
            failures.append(e)
            continue
        if instance.every is not None and facts.tp_size != len(instance.every):
            failures.append(
                SessionError(
                    f"prefill names {len(instance.every)} ranks; the service at {address} "
                    f"is a rank of {facts.tp_size}"
                )
            )
    if failures:
        raise failures[0]


def _tell(address: str, message: messages.Abandon, key: bytes, timeout: float) -> messages.Facts:
    """Say `message` to the prefill service at `address`: its facts, from its welcome."""
    conn = control.dial(address, key, timeout)
    try:
        control.write_message(conn, message, timeout)
        answer = control.read_message(conn, timeout)
    finally:
        conn.close()
    if isinstance(answer, messages.Refused):
        raise RefusedError(f"the prefill service at {address} refused: {answer.reason}")
    if not isinstance(answer, messages.Welcome) or answer.facts.role != "prefill":
        raise SessionError(f"the service at {address} answered an abandon with {answer!r}")
    return answer.facts


# ---- the decode side ------------------------------------------------------------------------


@dataclass(eq=False)
class _Service:
    """The session with one prefill rank's service."""

    address: str
    facts: messages.Facts
    link: control.ControlLink | None = None
    parts: set[str] = field(default_factory=set)  # claimed through it, not ended


@dataclass(frozen=True)
class _Prefill:
    """A prefill instance as a caller names it: rank 0's address (rank r serves at its
    port + r), or every rank's, in rank order."""

    rank0: str
    every: tuple[str, ...] | None

    @classmethod
    def parse(cls, prefill: object) -> _Prefill:
        if isinstance(prefill, str):
            control.parse_address(prefill, "prefill")
            return cls(prefill, None)
        every = tuple(prefill) if isinstance(prefill, (list, tuple)) else ()
        if not every:
            raise InvalidArgumentError(
                f"prefill must be rank 0's 'HOST:PORT' or every rank's, got {prefill!r}"
            )
        for rank, address in enumerate(every):
            control.parse_address(address, f"prefill[{rank}]")
        return cls(every[0], every)

    def address(self, rank: int) -> str:
        return rank_address(self.rank0, rank) if self.every is None else self.every[rank]


@dataclass(frozen=True)
class _Ask:
    """What a claim asks for, kept until the sessions it needs are up."""

    prefill: _Prefill
    blocks: list[int]
    tokens: int
    cached: int
    deadline: float  # monotonic: the claim's timeout, from the call
    layerwise: bool


@dataclass(eq=False)
class _Wanted:
    """A claimed request: what it asks, then its parts (once sent), and each part's
    outcome as it comes."""

    request_id: str
    ask: _Ask
    parts: dict[str, _Service] = field(default_factory=dict)
    ended: dict[str, Outcome] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)  # parts whose blocks are not free yet
    cancelled: bool = False  # before its claim went: a cancel follows the claim


class _Bell:
    """Rung at each word that something may be reported (under `lock`, the client's), for
    a poll(timeout) to wait on: no ring is lost between looking and waiting, since a
    waiter says which ring it last saw."""

    def __init__(self, lock: threading.Lock):
        self._rung = threading.Condition(lock)
        self.rings = 0
        self.waiting = 0  # polls in wait() now (a test waits for one to be there)

    def ring(self) -> None:
        self.rings += 1
        self._rung.notify_all()

    def wait(self, since: int, timeout: float, done: Callable[[], bool]) -> None:
        """Until a ring after `since`, `done()`, or `timeout` s."""
        self.waiting += 1
        try:
            self._rung.wait_for(lambda: self.rings != since or done(), timeout)
        finally:
            self.waiting -= 1


class DecodeClient:
    """Claims requests' KV into `receiver`'s caches from prefill services: one decode rank
    (`tp_rank` of `tp_size`) of a model with `kv_heads` KV heads, blocks of `block_tokens`.

    Thread-safe, and claim() never waits on the network: a session it needs is made (and
    after it ended, made again) on a thread of its own, within `connect_timeout`, while
    the engine goes on; a claim whose session cannot be made fails (reported by poll(),
    its blocks free). connect() makes them now, raising: for a compatibility check up
    front (a refused hello is RefusedError naming both sides). poll() reports each claimed
    request once; freed() names those whose blocks stayed held (Outcome.blocks_free False)
    once free. `clock`: what claims' timeouts are read on (a test's ManualClock)."""

    def __init__(
        self,
        receiver: KVReceiver,
        *,
        key: bytes,
        block_tokens: int,
        kv_heads: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        keepalive: float = 5.0,
        connect_timeout: float = 5.0,
        clock: Clock | None = None,
    ):
        if not isinstance(receiver, KVReceiver):
            raise InvalidArgumentError(f"receiver must be a KVReceiver, got {receiver!r}")
        if not isinstance(key, bytes) or not key:
            raise InvalidArgumentError("key must be non-empty bytes (the deployment's secret)")
        heads, rank, size = _split(receiver.layout, kv_heads, tp_rank, tp_size)
        self.receiver = receiver
        self._key = key
        self.keepalive = messages.keepalive(keepalive, "keepalive")
        self.connect_timeout = checks.seconds(connect_timeout, "connect_timeout")
        tokens = checks.integer(block_tokens, "block_tokens", 1, 1 << 20)
        self.facts = _facts(
            "decode", receiver.transport_name, tokens, heads, rank, size, self.keepalive
        )
        self._lock = threading.Lock()
        self._services: dict[str, _Service] = {}  # by address
        self._wanted: dict[str, _Wanted] = {}  # by request id
        self._part_of: dict[str, _Wanted] = {}  # by part id
        self._incarnations: dict[str, str] = {}  # address -> the service instance last seen
        self._lost_parts: dict[str, set[str]] = {}  # instance gone -> its held parts
        self._outcomes: list[Outcome] = []
        self._freed: list[str] = []
        self._bell = _Bell(self._lock)  # what poll(timeout) waits on
        #: one connect at a time per address (one session per service; a hung service
        #: delays no claim to another)
        self._dialing: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        #: address -> the claims waiting for its session, being made on a thread
        self._awaiting: dict[str, list[_Wanted]] = {}
        self._clock = Deadlines("pdhal-decode-clock", clock)  # claims' deadlines while unsent
        self._closed = False

    def claim(
        self,
        request_id: str,
        prefill: str | list[str],
        blocks,
        *,
        tokens: int,
        timeout: float,
        cached_blocks: int = 0,
        layerwise: bool = False,
    ) -> None:
        """Claim `request_id`'s KV from a prefill instance: `prefill` is its rank 0's address
        (rank r serves at that port + r), or every rank's, in rank order. The prompt's first
        `tokens` go into `blocks` (from block `cached_blocks` of the prompt on: those before
        it are cached here), within `timeout` s (else it fails; KVReceiver.expect). With
        every block cached (`blocks` empty) nothing is sent: it is reported landed at once,
        and the prefill side may free it.
        Never waits on the network: a session it needs is made in the background, and if
        it cannot be (unreachable, refused, its timeout passed first) the claim fails."""
        request_id = checks.name(request_id, "request_id")
        instance = _Prefill.parse(prefill)
        dst = checks.block_ids(
            blocks, "blocks", self.receiver.layout.num_blocks, "decode caches", unique=True
        )
        tokens = checks.integer(tokens, "tokens", 1)
        timeout = checks.seconds(timeout, "timeout")
        whole = -(-tokens // self.facts.block_tokens)
        cached = checks.integer(cached_blocks, "cached_blocks", 0, whole)
        layerwise = checks.flag(layerwise, "layerwise")
        longest = part_id(request_id, 1 << 16, 1 << 16)
        if len(longest) > messages.MOST_CHARS:
            raise InvalidArgumentError(
                f"request_id is {len(request_id)} characters: its parts' names must fit "
                f"{messages.MOST_CHARS}"
            )
        if len(dst) != whole - cached:
            raise InvalidArgumentError(
                f"request {request_id!r}: {tokens} tokens from block {cached} on are "
                f"{-(-tokens // self.facts.block_tokens) - cached} blocks, got {len(dst)}"
            )
        ask = _Ask(instance, dst, tokens, cached, self._clock.now() + timeout, layerwise)
        wanted = _Wanted(request_id, ask)
        with self._lock:
            self._open()
            if request_id in self._wanted:
                raise InvalidArgumentError(f"request {request_id!r} is claimed already")
            self._wanted[request_id] = wanted
        self._advance(wanted)

    def connect(self, prefill: str | list[str]) -> None:
        """Make the sessions with the prefill instance at `prefill` (as in claim) now: rank
        0's, then each rank this one takes heads from, each within `connect_timeout`.
        SessionError if one cannot be reached, RefusedError (naming both sides) if its hello
        is refused. claim() needs none of this; it checks compatibility up front."""
        instance = _Prefill.parse(prefill)
        self._open()
        size = self._check_rank(self._connect(instance.rank0), 0, None).facts.tp_size
        for rank in self._ranks(instance, size):
            self._check_rank(self._connect(instance.address(rank)), rank, size)

    def cancel(self, request_id: str) -> None:
        """The engine no longer wants `request_id` (aborted): each prefill rank stops
        sending its part; it is reported (poll) once every part ended."""
        request_id = checks.name(request_id, "request_id")
        with self._lock:
            wanted = self._wanted.get(request_id)
            if wanted is not None and not wanted.parts:  # its claim has not gone yet: the
                wanted.cancelled = True  # cancel follows it, so the prefill side hears it
                return
            parts = (
                []
                if wanted is None
                else [(p, s) for p, s in wanted.parts.items() if p not in wanted.ended]
            )
        for part, service in parts:
            if service.link is not None:
                service.link.send(messages.Cancel(part))

    def unsent(self) -> list[str]:
        """The claimed requests whose claims have not gone yet: the sessions they need are
        being made."""
        with self._lock:
            return [r for r, wanted in self._wanted.items() if not wanted.parts]

    def layers_landed(self, request_id: str) -> int:
        """How many layers of `request_id`, from the first, landed in every part
        (layerwise claims; KVReceiver.layers_landed)."""
        request_id = checks.name(request_id, "request_id")
        with self._lock:
            wanted = self._wanted.get(request_id)
        if wanted is None:
            raise InvalidArgumentError(f"request {request_id!r} is not claimed")
        counts = [0] if not wanted.parts else []  # (its claim has not gone yet)
        for part in wanted.parts:
            try:
                counts.append(self.receiver.layers_landed(part))
            except PdhalError:  # it failed (its copy into the caches, say): poll() says so
                counts.append(0)
                with self._lock:
                    self._bell.ring()
        return min(counts)

    def poll(self, timeout: float = 0.0) -> list[Outcome]:
        """The claimed requests that ended since the last poll: landed if every part did;
        blocks_free False while a part's prefill side may still write (freed() says when
        they are free). With nothing to report, it first waits up to `timeout` s for a word
        that something may be: a prefill side said a part ended or will not be served, a
        session ended, a claim failed before it went or a layer's copy failed, held blocks
        came free. One such word ends the wait, so it may return nothing: a caller waiting
        for a request loops on its own deadline. A sent claim's deadline passing rings
        nothing (it is seen at the next look); after close() it returns [] at once."""
        timeout = checks.timeout_or_zero(timeout, "timeout")
        with self._lock:
            since = self._bell.rings
        self._collect()
        if timeout > 0:
            with self._lock:
                idle = not (self._outcomes or self._closed)
                if idle:
                    self._bell.wait(since, timeout, lambda: self._closed)
            if idle:
                self._collect()
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def freed(self) -> list[str]:
        """Requests reported with blocks_free False whose blocks are free now, once each."""
        self._collect()
        with self._lock:
            out, self._freed = self._freed, []
        return out

    def close(self) -> None:
        """End every session (the receiver stays the caller's). Returns once each session's
        last words were written (a prefill side that reads nothing holds it up to the
        keepalive bound)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._bell.ring()
            services = list(self._services.values())
        self._clock.close()
        links = [service.link for service in services if service.link is not None]
        for link in links:
            link.end("the decode client closed", tell="the decode client closed")
        for link in links:  # said, not merely queued, by the time close() returns
            link.wait_closed()

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------

    def _open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the decode client was closed")

    def _advance(self, wanted: _Wanted) -> None:
        """Send `wanted`'s claim if every session it needs is up; else wait for the first
        one missing (made on a thread of its own, which advances it again). It fails, its
        blocks free, if a session cannot be made or its timeout passes first."""
        instance = wanted.ask.prefill
        with self._lock:
            if self._wanted.get(wanted.request_id) is not wanted:
                return  # ended meanwhile (its timeout passed while its session was made)
        try:
            if self._clock.now() >= wanted.ask.deadline:
                raise SessionError("its timeout passed before its sessions were made")
            rank0 = self._live(instance.rank0)
            if rank0 is None:
                self._await(instance.rank0, wanted)
                return
            size = self._check_rank(rank0, 0, None).facts.tp_size
            services = {}
            for rank in self._ranks(instance, size):
                service = self._live(instance.address(rank))
                if service is None:
                    self._await(instance.address(rank), wanted)
                    return
                services[rank] = self._check_rank(service, rank, size)
        except (SessionError, InvalidArgumentError) as e:
            self._unsent(wanted, str(e))
            return
        self._send(wanted, services)

    def _send(self, wanted: _Wanted, services: dict[int, _Service]) -> None:
        """`wanted`'s claim (or, every block cached here, its `cached`) to each of
        `services`, by prefill rank, unless it ended meanwhile (its timeout); a cancel
        that came first follows it."""
        ask, request_id = wanted.ask, wanted.request_id
        parts = {part_id(request_id, r, self.facts.tp_rank): s for r, s in services.items()}
        if ask.cached == -(-ask.tokens // self.facts.block_tokens):  # nothing comes
            with self._lock:
                if self._wanted.get(request_id) is not wanted:
                    return  # ended meanwhile (its timeout)
                del self._wanted[request_id]
                for part, service in parts.items():  # (nothing comes: its blocks are free)
                    service.link.send(messages.Cached(request_id, part))
                self._outcomes.append(
                    Outcome(request_id, False, "cancelled")
                    if wanted.cancelled
                    else Outcome(request_id, True)
                )
                self._bell.ring()
            return
        tickets = {}
        try:
            left = max(1e-3, ask.deadline - self._clock.now())
            for part in parts:
                tickets[part] = self.receiver.expect(
                    part, left, layerwise=ask.layerwise, blocks=ask.blocks
                )
        except PdhalError as e:
            self._unsent(wanted, str(e), tickets)
            return
        with self._lock:  # (sent under it: a cancel now comes after the claims, on each link)
            current = self._wanted.get(request_id) is wanted
            if current:
                wanted.parts = parts
                for part, service in parts.items():
                    self._part_of[part] = wanted
                    service.parts.add(part)
                    service.link.send(
                        messages.Claim(
                            request_id, part, ask.blocks, ask.tokens, ask.cached, tickets[part]
                        )
                    )
                    if wanted.cancelled:
                        service.link.send(messages.Cancel(part))
        if not current:  # ended meanwhile (its timeout: reported then)
            self._unsent(wanted, "", tickets)
            return
        for part, service in parts.items():
            if service.link.ended:  # (its on_lost may have run before the part was added)
                self._end_part(part, "its session ended before the claim went", unwritten=True)

    def _unsent(self, wanted: _Wanted, why: str, tickets=()) -> None:
        """`wanted` failed before its claim went (nothing of it can be written): `tickets`
        made for it are dropped, and it is reported with `why` unless it ended already."""
        for part in tickets:  # (their outcomes are nobody's: _collect drops them)
            with contextlib.suppress(PdhalError):
                self.receiver.abandon(part, "its claim was not sent", unwritten=True)
        with self._lock:
            if self._wanted.get(wanted.request_id) is wanted and not wanted.parts:
                del self._wanted[wanted.request_id]
                if not self._closed:  # (after close() nothing is reported)
                    self._outcomes.append(Outcome(wanted.request_id, False, _bounded(why)))
                    self._bell.ring()

    def _ranks(self, instance: _Prefill, size: int) -> list[int]:
        """The ranks of `instance` (of `size`) this rank takes heads from."""
        if instance.every is not None and len(instance.every) != size:
            raise InvalidArgumentError(
                f"prefill names {len(instance.every)} ranks; the instance at {instance.rank0} "
                f"has {size}"
            )
        shards = head_shards(self.facts.kv_heads, size, self.facts.tp_size)
        return sorted(src for src, dst_rank in shards if dst_rank == self.facts.tp_rank)

    @staticmethod
    def _check_rank(service: _Service, rank: int, size: int | None) -> _Service:
        facts = service.facts
        if facts.tp_rank != rank or size not in (None, facts.tp_size):
            raise SessionError(
                f"the service at {service.address} is prefill rank {facts.tp_rank} of "
                f"{facts.tp_size}, expected rank {rank}{'' if size is None else f' of {size}'} "
                f"(rank r serves at rank 0's port + r)"
            )
        return service

    def _live(self, address: str) -> _Service | None:
        with self._lock:
            service = self._services.get(address)
        return service if service is not None and not service.link.ended else None

    def _await(self, address: str, wanted: _Wanted) -> None:
        """`wanted` waits for the session with `address`, made on a thread of its own (one
        per address at a time), which advances each claim waiting once it is made or
        failed."""
        with self._lock:
            self._open()
            waiting = self._awaiting.get(address)
            first = waiting is None
            if first:
                waiting = self._awaiting[address] = []
            waiting.append(wanted)
        self._clock.at(  # (it fails by its own timeout, whatever the dial takes)
            wanted.ask.deadline,
            lambda: self._unsent(wanted, "its timeout passed before its sessions were made"),
        )
        if first:
            threading.Thread(
                target=self._connect_for, args=(address,), name="pdhal-session-dial", daemon=True
            ).start()

    def _connect_for(self, address: str) -> None:
        error = None
        try:
            self._connect(address)
        except PdhalError as e:
            error = str(e)
        except Exception as e:  # a bug: still, the claims waiting on it end
            log.exception("pdhal.transfer: making the session with %s failed", address)
            error = f"making the session with {address} failed: {type(e).__name__}: {e}"
        with self._lock:
            waiting = self._awaiting.pop(address, [])
        for wanted in waiting:
            if error is None:
                self._advance(wanted)
            else:
                self._unsent(wanted, error)

    def _connect(self, address: str) -> _Service:
        """The live session with `address`, made if need be (one dial at a time each)."""
        with self._lock:
            dialing = self._dialing[address]
        with dialing:
            return self._live(address) or self._dial(address)

    def _dial(self, address: str) -> _Service:
        conn = control.dial(address, self._key, self.connect_timeout)
        try:
            hello = messages.Hello(messages.PROTOCOL, self.facts, self.receiver.describe())
            control.write_message(conn, hello, self.connect_timeout)
            answer = control.read_message(conn, self.connect_timeout)
        except PdhalError as e:
            conn.close()
            raise SessionError(f"the session with {address} failed at its hello: {e}") from None
        if isinstance(answer, messages.Refused):
            conn.close()
            raise RefusedError(f"the prefill service at {address} refused: {answer.reason}")
        if not isinstance(answer, messages.Welcome) or answer.facts.role != "prefill":
            conn.close()
            raise SessionError(f"the service at {address} answered the hello with {answer!r}")
        service = _Service(address, answer.facts)
        service.link = control.ControlLink(
            conn,
            keepalive=self.keepalive,
            peer_keepalive=answer.facts.keepalive,
            on_message=lambda m: self._heard(service, m),
            on_lost=lambda why: self._lost(service, why),
            name=f"pdhal-session-prefill{answer.facts.tp_rank}",
        )
        with self._lock:
            if self._closed:
                conn.close()
                raise InvalidArgumentError("the decode client was closed")
            self._services[address] = service
            gone = self._incarnations.get(address)
            self._incarnations[address] = answer.facts.instance
            stale = self._lost_parts.pop(gone, set()) if gone != answer.facts.instance else set()
        service.link.start()
        self._release(stale)  # its old service is gone: nothing writes them any more
        return service

    def _release(self, parts) -> None:
        """Free the held blocks of `parts`: nothing can write them any more."""
        for part in parts:
            with contextlib.suppress(InvalidArgumentError, ClosedHandleError):  # its word came
                self.receiver.release(part)
        if parts:
            with self._lock:
                self._bell.ring()

    def _gone(self, service: _Service) -> None:
        """After `service`'s session was lost with parts held: if its address refuses a
        connection now, nothing listens there, so that instance is gone (dead, or closed
        once its writes settled: a service closes its listener last) and its held parts
        are freed; else they stay held until its failure words come, or a successor
        answers there. (A stopped or cut-off service's address does not refuse.)"""
        host, port = control.parse_address(service.address, "prefill")
        for pause in PROBES_S:  # (a dying process may close its session before its listener)
            time.sleep(pause)
            try:
                socket.create_connection((host, port), timeout=self.connect_timeout).close()
            except ConnectionRefusedError:
                break
            except OSError:
                return  # unreachable: it may be alive
        else:
            return  # something listens there: that instance, or a successor
        with self._lock:
            gone = self._lost_parts.pop(service.facts.instance, set())
        self._release(gone)

    def _heard(self, service: _Service, message: messages.Message) -> None:
        if isinstance(message, messages.Ended):
            with self._lock:  # (a part of this session's: another's wakes nobody)
                wanted = self._part_of.get(message.part)
                if wanted is not None and wanted.parts.get(message.part) is service:
                    self._bell.ring()
            return
        if isinstance(message, messages.Unserved):
            with self._lock:  # (held parts too: their deadline may have passed first)
                wanted = self._part_of.get(message.part)
                owner = wanted.parts.get(message.part) if wanted is not None else None
                # (claimed on an earlier session with it, maybe: the address is what counts)
                known = owner is not None and owner.address == service.address
            if known:
                self._end_part(message.part, message.reason, unwritten=True)
            return
        service.link.end(
            f"the prefill side sent a {message.TYPE} mid-session",
            tell=f"a {message.TYPE} is not a message a prefill side sends mid-session",
        )

    def _lost(self, service: _Service, why: str) -> None:
        with self._lock:
            if self._closed:
                return  # (the receiver may be closed already: nothing is reported now)
            parts = list(service.parts)
        for part in parts:
            self._part_lost(part, f"the session with {service.address} ended: {why}")
        with self._lock:
            held = bool(self._lost_parts.get(service.facts.instance))
        if held:
            self._gone(service)

    def _part_lost(self, part: str, why: str) -> None:
        """Its link went: it fails now, its blocks held (the prefill side may be alive),
        unless a restarted service answers at its address already (the old one is gone)."""
        with self._lock:
            wanted = self._part_of.get(part)
            service = wanted.parts[part] if wanted is not None else None
            if service is None:
                return
            gone = self._incarnations.get(service.address) != service.facts.instance
            if not gone:
                self._lost_parts.setdefault(service.facts.instance, set()).add(part)
        self._end_part(part, why, unwritten=gone)

    def _end_part(self, part: str, why: str, *, unwritten: bool) -> None:
        try:
            self.receiver.abandon(part, _bounded(why), unwritten=unwritten)
        except ClosedHandleError:
            return  # the engine closed the receiver: nothing is reported any more
        except InvalidArgumentError:  # ended already
            if unwritten:  # held (its deadline passed): nothing will write it
                with contextlib.suppress(InvalidArgumentError, ClosedHandleError):
                    self.receiver.release(part)
        with self._lock:
            self._bell.ring()

    def _collect(self) -> None:
        """The receiver's outcomes and freed parts, as requests."""
        outcomes = self.receiver.poll()
        freed = self.receiver.freed()
        cancels = []
        with self._lock:
            for outcome in outcomes:
                wanted = self._part_of.get(outcome.request_id)
                if wanted is None:
                    continue
                wanted.ended[outcome.request_id] = outcome
                wanted.parts[outcome.request_id].parts.discard(outcome.request_id)
                if not outcome.blocks_free:
                    wanted.held.add(outcome.request_id)
                if not outcome.landed:  # the other parts are of no use now
                    cancels += [(p, s) for p, s in wanted.parts.items() if p not in wanted.ended]
                if len(wanted.ended) == len(wanted.parts):
                    self._report(wanted)
            for part in freed:
                wanted = self._part_of.pop(part, None)
                if wanted is None:
                    continue
                wanted.held.discard(part)
                if not wanted.held and len(wanted.ended) == len(wanted.parts):
                    self._freed.append(wanted.request_id)
                for lost in self._lost_parts.values():
                    lost.discard(part)
        for part, service in cancels:
            if service.link is not None:
                service.link.send(messages.Cancel(part))

    def _report(self, wanted: _Wanted) -> None:
        """Every part of `wanted` ended (under the lock): its outcome."""
        del self._wanted[wanted.request_id]
        for part in wanted.parts:
            if part not in wanted.held:
                self._part_of.pop(part, None)
        failed = [o.reason for o in wanted.ended.values() if not o.landed]
        self._outcomes.append(
            Outcome(
                wanted.request_id,
                not failed,
                "; ".join(dict.fromkeys(failed)),
                blocks_free=not wanted.held,
            )
        )
