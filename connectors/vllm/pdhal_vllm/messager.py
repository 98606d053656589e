"""The cache messager of one prefill rank: `python -m pdhal_vllm.messager --listen HOST:PORT`.

Configuration around pdhal.transfer.KVStreamer, one per prefill worker: the streamer sends
each layer's blocks into the decode workers' caches (--transport: shm on one host, mooncake
across hosts), and this process only says what to send. The prefill worker sends each
step's table (request, transfer id, its blocks, the tokens the step wrote) before the
step's first layer signal: a request becomes the streamer's when its table first names all
its blocks, and the table and the layer signals (read through pdhal: a futex wait, never a
sleep loop) drive the streamer through pdhal.transfer.PerQueryFeed. A decode worker sends
its KV receiver's description once (hello), then per request its ticket and the blocks it
allocated ("want"): the request's destination, with the tokens it needs (in sync mode one
less: it computes the last prompt token itself) and the prompt blocks it has cached. Each
outcome the streamer reports is told to the prefill worker, which then frees the blocks;
the decode worker reads its own in its receiver's status slots.

Tensor parallelism (--prefill-tp P, --decode-tp D; one messager per prefill rank, listening
on consecutive ports): the ranks of each side split the KV heads (pdhal.transfer.head_shards),
and this rank sends each decode rank the heads both hold, as a part of its own in the
streamer (pdhal.transfer.part_id: "TID@PREFILL_RANK>DECODE_RANK", the name that rank expects it
under), into that rank's own ticket. A transfer ends for the prefill worker once every
part ended: landed if all did. A worker whose split does not match is
refused at its hello, a decode cache whose heads do not pair at its first request.

Failures end transfers, never wait on them: a dead prefill worker (pdhal sees its channel's
lock drop) aborts the streamer, which fails every unfinished transfer to its decode side; a
decode worker that is gone (its connection closed, its process gone, a write to it failed)
has its transfers failed to the prefill side; a transfer no decode worker claims within
--claim-timeout is failed to the prefill side. A decode worker whose request vLLM aborted
mid-load says "cancel": its part stops (answered at once if its table has not come), so
the decode side frees the blocks without waiting for its load timeout.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener

import pdhal
from pdhal import PdhalError, ProducerDiedError, SignalTimeoutError, ops, transfer
from pdhal.transfer import (
    CacheLayout,
    CacheSpec,
    KVStreamer,
    PerQueryFeed,
    head_shards,
    part_id,
    rank_heads,
    request_of,
)
from pdhal_vllm.wire import (
    ConnectorError,
    Tracer,
    auth_key,
    head_crcs,
    parse_address,
)

#: tests: "exit-after-layers:N" exits (status 3) once the streamer has landed N layer submits
FAULT_VAR = "PDHAL_VLLM_MESSAGER_FAULT"
#: Transfer ids of ended transfers kept, so a later table entry of one is not sent again.
ENDED = 10000
#: After a worker went, how long (s) its segments are looked for, and how often: a worker
#: vLLM killed outright (its default shutdown) cannot remove its KV cache segment itself.
RECLAIM_S, RECLAIM_EVERY_S = 10.0, 0.5


@dataclass
class Peer:
    """A connected worker: its connection and its hello (a decode worker's has its KV
    receiver's description)."""

    role: str
    conn: Connection
    hello: dict
    lock: threading.Lock = field(default_factory=threading.Lock)
    alive: bool = True

    @property
    def pid(self):
        return self.hello.get("pid")

    def send(self, *message) -> None:
        if not self.alive:
            return
        try:
            with self.lock:
                self.conn.send(message)
        except OSError:
            self.alive = False


@dataclass
class Added:
    """A request the streamer has, as one part per decode rank it sends heads to: its
    prompt's length, the source blocks given so far, what its decode side needs once it
    asked (tokens; the prompt blocks it has cached), the tokens given per layer (for the
    trace), the parts not ended and why the failed ones failed."""

    prompt: int
    blocks: list[int]
    ready: list[int]
    parts: set[str]
    tokens: int = 0
    cached: int = 0
    failures: list[str] = field(default_factory=list)


class _Feed:
    """The streamer as PerQueryFeed drives it: every layer handed to it is also traced and
    checked against the planted fault."""

    def __init__(self, messager: Messager, streamer: KVStreamer):
        self.layout = streamer.layout
        self._messager, self._streamer = messager, streamer

    def layer_ready(self, layer: int, ready, signal_ns=None, *, step=None) -> None:
        added = self._messager.added
        parts = [(p, tokens) for tid, tokens in ready if tid in added for p in added[tid].parts]
        self._messager.check_fault()
        self._streamer.layer_ready(layer, parts, signal_ns, step=step)
        self._messager.given(layer, ready)


class Messager:
    def __init__(
        self,
        listen: str,
        rank: int,
        key: bytes,
        transport: str,
        claim_timeout: float,
        trace: str | None,
        trace_blocks: bool = False,
        prefill_ranks: int = 1,
        decode_ranks: int | None = None,
    ):
        if transport not in transfer.transports():  # any installed plugin (pdhal info)
            raise ConnectorError(
                f"transport {transport!r} is not installed; installed: "
                f"{', '.join(transfer.transports())}"
            )
        if not 0 <= rank < prefill_ranks:
            raise ConnectorError(f"--rank must be in [0, {prefill_ranks}) (--prefill-tp)")
        self.rank, self.transport = rank, transport
        self.prefill_ranks = prefill_ranks
        self.decode_ranks = decode_ranks or prefill_ranks
        self.shards: dict = {}  # decode rank -> the HeadShard this rank sends it
        self.kv_heads = 0  # the model's, from the prefill worker's hello
        self.claim_timeout = claim_timeout
        self.trace = Tracer(trace)
        self.trace_blocks = bool(trace) and trace_blocks
        self.events: queue.Queue = queue.Queue()
        self.prefill: Peer | None = None
        self.src = None  # the prefill cache, mapped
        self.layout: list[list[int]] = []  # per layer: offset, stride, block bytes, blocks
        self.block_size = 0
        self.streamer: KVStreamer | None = None
        self.feed: PerQueryFeed | None = None
        self.added: dict[str, Added] = {}  # transfer id -> the request in the streamer
        self.claimed: dict[str, Peer] = {}  # part -> its decode worker
        self.decodes: list[Peer] = []  # the decode workers connected
        self.wants: dict[str, tuple[Peer, dict, float]] = {}  # by part, not claimed yet
        self.unneeded: set[str] = set()  # parts ended because their decode side needs none
        #: transfer id -> "" (sent) or why it failed, for the last ENDED transfers
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._mark = 0  # trace: streamer.metrics.layers_since's cursor
        self._reclaim_until = time.monotonic() + RECLAIM_S  # and at start: a killed run's
        self._next_reclaim = 0.0
        fault = os.environ.get(FAULT_VAR, "")
        self.exit_after = (
            int(fault.split(":")[1]) if fault.startswith("exit-after-layers:") else None
        )
        self.layers_given = 0  # layer submits the streamer was given (the fault counts them)
        bind = parse_address(listen)
        self.listener = Listener(bind, authkey=key)
        self.address = f"{bind[0]}:{self.listener.address[1]}"

    # ---- connections --------------------------------------------------------------------

    def serve(self) -> None:
        threading.Thread(target=self._accept, name="pdhal-vllm-accept", daemon=True).start()
        print(
            f"pdhal-vllm messager rank {self.rank} of {self.prefill_ranks} listening on "
            f"{self.address}",
            flush=True,
        )
        self.trace("listening", address=self.address, transport=self.transport)
        while True:
            busy = self.streamer is not None and self.streamer.pending()
            try:
                event = self.events.get(timeout=0.1 if busy else 0.5)
            except queue.Empty:
                event = ("tick",)
            try:
                self._handle(event)
                self._trace_layers()
                self._reclaim()
            except (ConnectorError, PdhalError) as exc:
                self._report(str(exc))
            except Exception:  # a bug: say so, and keep serving the other transfers
                self._report(traceback.format_exc())

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except Exception as exc:  # a client without the key, or one that hung up
                self.trace("refused", error=f"{type(exc).__name__}: {exc}")
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            kind, hello = conn.recv()
        except (EOFError, OSError):
            return
        if kind != "hello" or hello.get("role") not in ("prefill", "decode"):
            conn.close()
            return
        peer = Peer(hello["role"], conn, hello)
        self.events.put(("hello", peer))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self.events.put((message[0], peer, *message[1:]))
        peer.alive = False
        self.events.put(("gone", peer))

    def _watch(self, peer: Peer) -> None:
        """The pdhal reader of the prefill worker's layer signals: one event per wake-up."""
        try:
            reader = ops.open_kv_signal_reader(self.rank, 0, timeout=30.0)
        except PdhalError as exc:
            self.events.put(("prefill_died", peer, f"no layer-signal channel: {exc}"))
            return
        seen = reader.wait((0, -1), timeout=30.0)  # the worker's opening step
        self.events.put(("progress", peer, seen, time.monotonic_ns()))
        while peer.alive:
            try:
                seen = reader.wait(seen, timeout=1.0)
            except SignalTimeoutError:
                continue
            except ProducerDiedError as exc:
                self.events.put(("prefill_died", peer, str(exc)))
                break
            self.events.put(("progress", peer, seen, time.monotonic_ns()))
        reader.close()

    # ---- events -------------------------------------------------------------------------

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "hello":
            self._hello(event[1])
        elif kind == "table":
            _, peer, step, entries = event
            if peer is self.prefill and self.feed is not None:
                self.trace("table", step=step, tids=[e["tid"] for e in entries])
                for entry in entries:
                    self._add(entry)
                self.feed.step(step, [(e["tid"], e["end"]) for e in entries])
        elif kind == "progress":
            _, peer, seen, t = event
            if peer is self.prefill and self.feed is not None:
                self.trace("seen", step=seen[0], layer=seen[1], t=t)
                self.feed.progress(tuple(seen), t)
        elif kind == "outcome":
            if event[1] is self.streamer:
                self._outcome(event[2])
        elif kind == "want":
            self._want(event[1], event[2])
        elif kind == "unneeded":
            self._want(event[1], {"tid": event[2]["tid"], "unneeded": True})
        elif kind == "cancel":
            self._cancel(event[1], event[2]["tid"])
        elif kind == "gone":
            peer = event[1]
            self._gone(peer, f"the {peer.role} worker (pid {peer.pid}) closed its connection")
        elif kind == "prefill_died":
            self._gone(event[1], f"the prefill worker died: {event[2]}")
        self._expire_wants()

    def _hello(self, peer: Peer) -> None:
        hello = peer.hello
        self.trace("hello", role=peer.role, peer_pid=peer.pid)
        ranks = self.decode_ranks if peer.role == "decode" else self.prefill_ranks
        if hello.get("ranks", 1) != ranks or (
            peer.role == "prefill" and hello["rank"] != self.rank
        ):
            flag = "--decode-tp" if peer.role == "decode" else "--rank, --prefill-tp"
            self._refuse(
                peer,
                f"this messager serves {peer.role} rank(s) of tensor parallelism {ranks} "
                f"({flag}); the {peer.role} worker is rank {hello.get('rank', 0)} of "
                f"{hello.get('ranks', 1)}",
            )
            return
        if peer.role == "decode":
            theirs = (hello.get("described") or {}).get("transport")
            if theirs != self.transport:
                self._refuse(
                    peer,
                    f"this messager streams over {self.transport} (its --transport); the "
                    f"decode worker's KV receiver is on {theirs} (kv_connector_extra_config "
                    f"'transport')",
                )
                return
            self.decodes.append(peer)
            if self.streamer is not None:
                self._connect(peer)  # one that cannot be reached is refused
            peer.send("ready", self._ready())  # (nothing goes to a refused one)
            return
        if self.prefill is not None and self.prefill.alive:
            self._refuse(peer, "this messager already serves a prefill worker")
            return
        if self.prefill is not None:  # gone, its "gone" not handled yet
            self._end_prefill(f"the prefill worker (pid {self.prefill.pid}) was replaced")
        try:
            shards = head_shards(hello["kv_heads"], self.prefill_ranks, self.decode_ranks)
            src = ops.share_external_data("uint8", hello["cache"], [hello["nbytes"]])
            layout = CacheLayout([src], [[CacheSpec(0, *layer)] for layer in hello["layers"]])
            streamer = KVStreamer(
                layout,
                hello["block_size"],
                transport_name=self.transport,
                claim_timeout=self.claim_timeout,
                on_outcome=lambda outcome: self.events.put(("outcome", streamer, outcome)),
            )
        except (PdhalError, KeyError, TypeError) as exc:
            self._refuse(peer, f"the messager cannot stream from this prefill cache: {exc}")
            return
        self.prefill, self.src, self.streamer = peer, src, streamer
        self.layout, self.block_size = hello["layers"], hello["block_size"]
        self.kv_heads = hello["kv_heads"]
        self.shards = {d: shard for (r, d), shard in shards.items() if r == self.rank}
        for tid in hello.get("failed", ()):  # while no messager was there
            self._ended(tid, "the cache messager was gone (restarted since)")
        self.feed = PerQueryFeed(_Feed(self, streamer))
        self._mark = 0
        threading.Thread(
            target=self._watch, args=(peer,), name="pdhal-vllm-reader", daemon=True
        ).start()
        peer.send("ready", self._ready())
        for decode in list(self.decodes):
            self._connect(decode)

    def _ready(self) -> dict:
        """The answer to a hello: where this is, and the tensor-parallel splits it serves."""
        return {
            "address": self.address,
            "prefill_ranks": self.prefill_ranks,
            "decode_ranks": self.decode_ranks,
        }

    def _connect(self, peer: Peer):
        """The streamer's destination for decode worker `peer`, sent the heads its rank
        gets from this one (connected once: the streamer keeps it), or None, and `peer`
        refused, if it cannot be reached or its heads do not pair with these."""
        rank = peer.hello.get("rank", 0)
        if rank not in self.shards:
            return None  # a decode rank holding none of this rank's heads: nothing to send
        if peer.hello.get("kv_heads") != self.kv_heads:
            self._refuse(
                peer,
                f"the decode model has {peer.hello.get('kv_heads')} KV heads, the prefill "
                f"model {self.kv_heads}",
            )
            return None
        try:
            return self.streamer.connect(peer.hello["described"], heads=self.shards[rank])
        except PdhalError as exc:
            self._refuse(peer, f"the messager cannot reach its decode cache: {exc}")
            return None

    def _refuse(self, peer: Peer, why: str) -> None:
        """Tell `peer` why it is not served, and drop its connection."""
        peer.send("error", why)
        peer.alive = False
        if peer in self.decodes:
            self.decodes.remove(peer)
        peer.conn.close()
        self._report(f"refused the {peer.role} worker (pid {peer.pid}): {why}")

    # ---- requests and their destinations ----------------------------------------------

    def _add(self, entry: dict) -> None:
        """Give the streamer the request of a table entry, or the blocks its table names
        that the streamer does not have yet (vLLM allocates a chunked prompt's blocks chunk
        by chunk: each layer's blocks go once their tokens and their ids are there)."""
        tid = entry["tid"]
        if tid in self.ended:
            return
        prompt = entry["prompt_len"]
        blocks = entry["blocks"][: -(-prompt // self.block_size)]  # the prompt's only
        added = self.added.get(tid)
        parts = [part_id(tid, self.rank, d) for d in sorted(self.shards)]
        if not parts:  # its heads are replicated: another prefill rank sends them
            self._end(tid, True, "")
            return
        try:
            if added is None:
                for part in parts:
                    self.streamer.add_request(part, blocks, prompt)
                self.added[tid] = Added(prompt, list(blocks), [0] * len(self.layout), set(parts))
                for part in parts:
                    if part in self.wants:  # its decode rank asked first
                        self._claim(part)
            elif len(blocks) > len(added.blocks):
                for part in added.parts:
                    self.streamer.add_blocks(part, blocks[len(added.blocks) :])
                added.blocks = list(blocks)
        except PdhalError as exc:
            why = f"the messager cannot stream it: {exc}"
            if tid not in self.added:
                self.added[tid] = Added(prompt, list(blocks), [0] * len(self.layout), set())
            for part in parts:
                if part in self.streamer:
                    self.streamer.fail(part, why)
                else:
                    self._part_ended(part, False, why)

    def _want(self, peer: Peer, want: dict) -> None:
        tid = want["tid"]
        part = part_id(tid, self.rank, peer.hello.get("rank", 0))
        self.trace("want", tid=tid, blocks=len(want.get("blocks", ())), peer_pid=peer.pid)
        if part in self.claimed or part in self.wants:
            self._report(f"transfer {part}: asked for twice; the second ask is ignored")
            return
        self.wants[part] = (peer, want, time.monotonic())
        if tid in self.added:  # the prefill side's table came first
            self._claim(part)
        elif self.ended.get(tid):  # failed before it asked (a messager restart, ...)
            self._unserved(part, self.ended[tid])

    def _cancel(self, peer: Peer, tid: str) -> None:
        """The decode rank at `peer` no longer needs transfer `tid` (vLLM aborted the
        request): stop sending its part, so the decode side frees the blocks now. A part
        still waiting for its prefill table is answered at once, and fails to the prefill
        side once the table comes."""
        part = part_id(tid, self.rank, peer.hello.get("rank", 0))
        why = "its decode request was cancelled"
        self.trace("cancel", tid=tid, peer_pid=peer.pid)
        if part in self.claimed:
            self.streamer.fail(part, why)  # (one wholly sent lands all the same)
        elif part in self.wants and not self.wants[part][1].get("cancelled"):
            since = self.wants[part][2]
            self._unserved(part, why)
            self.wants[part] = (peer, {"tid": tid, "cancelled": True}, since)

    def _claim(self, part: str) -> None:
        """Set the destination of `part`, in the streamer, from its decode rank's want: the
        tokens it needs (in sync mode one less: it computes the last prompt token itself)
        from the first block it has not cached."""
        peer, want, _ = self.wants.pop(part)
        tid = request_of(part)
        added = self.added[tid]
        if peer.hello.get("rank", 0) not in self.shards:  # it gets no heads from this rank
            self._report(f"transfer {part}: that decode rank gets no heads from rank {self.rank}")
            return
        if want.get("unneeded"):  # its prefix cache has it: the prefill side frees it now
            self.unneeded.add(part)
            self.streamer.fail(part, "its decode side needs none of it (cached there)")
            return
        if want.get("cancelled"):  # answered already: the prefill side frees it now
            self.streamer.fail(part, "its decode request was cancelled")
            return
        if not peer.alive:
            why = f"the decode worker (pid {peer.pid}) closed its connection"
        elif peer.hello.get("block_size") != self.block_size:
            why = (
                f"the decode cache has blocks of {peer.hello.get('block_size')} tokens, the "
                f"prefill cache of {self.block_size}"
            )
        else:
            tokens, cached = min(added.prompt, want["num_tokens"]), want["cached_blocks"]
            blocks = want["blocks"][cached : -(-tokens // self.block_size)]
            dest = self._connect(peer)  # refused: its loads fail as its connection drops
            why = None if dest is not None else f"the messager cannot reach pid {peer.pid}"
        if why is None:
            try:
                self.streamer.set_destination(
                    part, dest, blocks, want["ticket"], tokens=tokens, cached_blocks=cached
                )
            except PdhalError as exc:
                why = str(exc)
        if why is not None:
            self.streamer.fail(part, why)  # the decode side ends it by its load timeout
            return
        added.tokens, added.cached = tokens, cached
        self.claimed[part] = peer
        if self.trace.on:  # the layers ready already went with the destination
            now = time.monotonic_ns()
            for layer, ready in enumerate(added.ready):
                if ready:
                    self.trace("read", tid=tid, layer=layer, t=now)

    def given(self, layer: int, ready) -> None:
        """The streamer was given `layer` of `ready` (from the feed)."""
        now = time.monotonic_ns()
        for tid, tokens in ready:
            added = self.added.get(tid)
            if added is not None:
                added.ready[layer] = max(added.ready[layer], tokens)
                if any(part in self.claimed for part in added.parts):
                    self.trace("read", tid=tid, layer=layer, t=now)
        self.layers_given += 1

    def check_fault(self) -> None:
        """The planted fault (tests): exit-after-layers:N exits before the streamer is given
        layer submit N + 1, once the N given landed, so the decode cache holds exactly
        those however the layer signals were batched."""
        if self.exit_after is None or self.streamer is None or self.layers_given < self.exit_after:
            return
        deadline = time.monotonic() + 10.0
        while self.streamer.metrics.layers_landed < self.exit_after and time.monotonic() < deadline:
            time.sleep(0.001)  # (a test hook, once: the copies of those N run meanwhile)
        self.trace("fault", what="exit", layers=self.streamer.metrics.layers_landed)
        os._exit(3)

    # ---- outcomes -----------------------------------------------------------------------

    def _outcome(self, outcome) -> None:
        """A part ended (the streamer's on_outcome, through the event queue)."""
        part = outcome.request_id
        self.claimed.pop(part, None)
        if part in self.unneeded:  # not a failure: nothing was to go
            self.unneeded.discard(part)
            self._part_ended(part, True, "")
        else:
            self._part_ended(part, outcome.landed, outcome.reason)

    def _part_ended(self, part: str, landed: bool, why: str) -> None:
        """Once every part of its transfer ended, tell the prefill worker, which frees the
        blocks: landed if every part landed."""
        tid = request_of(part)
        added = self.added.get(tid)
        if added is None:
            return
        added.parts.discard(part)
        if not landed:
            added.failures.append(why)
        if added.parts:
            return
        del self.added[tid]
        if not added.failures and self.trace_blocks:
            self._trace_source(tid, added)
        self._end(tid, not added.failures, "; ".join(added.failures))

    def _end(self, tid: str, landed: bool, why: str) -> None:
        self._ended(tid, "" if landed else why or "failed")
        if landed:
            self.trace("sent", tid=tid)
            if self.prefill is not None:
                self.prefill.send("sent", tid)
            return
        self._report(f"transfer {tid}: {why}")
        if self.prefill is not None:
            self.prefill.send("failed", tid, why)

    def _ended(self, tid: str, why: str) -> None:
        """Remember that `tid` ended (`why` "": sent), and answer a decode rank that still
        waits for a part of it: nothing more of it comes."""
        self.ended[tid] = why
        while len(self.ended) > ENDED:
            self.ended.popitem(last=False)
        for part in [p for p in self.wants if request_of(p) == tid]:
            self._unserved(part, why or "it ended before its decode side asked")

    def _unserved(self, part: str, why: str) -> None:
        """Tell the decode worker that asked for `part` it will not come (it fails the load
        now, not at its load timeout)."""
        peer, want, _ = self.wants.pop(part)
        if want.get("cancelled"):  # its decode rank was answered when it cancelled
            return
        self._report(f"transfer {part}: not served: {why}")
        peer.send("unserved", {"tid": request_of(part), "why": why})

    def _trace_layers(self) -> None:
        """The streamer's per-layer numbers since the last call, as "landed" events."""
        if not self.trace.on or self.streamer is None:
            return
        records, self._mark = self.streamer.metrics.layers_since(self._mark)
        for record in records:
            self.trace(
                "landed" if record.landed else "layer_failed",
                step=record.step,
                layer=record.layer,
                requests=record.requests,
                nbytes=record.nbytes,
                signal_ns=record.signal_ns,
                submit_ns=record.submit_ns,
                t=record.end_ns,
            )

    def _trace_source(self, tid: str, added: Added) -> None:
        """crc32 of each head of each block the transfer sent, in the prefill cache (which
        holds them until the prefill worker hears the transfer ended)."""
        head0 = rank_heads(self.kv_heads, self.prefill_ranks, self.rank).start
        for layer, (offset, stride, nbytes, _, heads) in enumerate(self.layout):
            for i in range(added.cached, -(-added.tokens // self.block_size)):
                start = offset + added.blocks[i] * stride
                crcs = head_crcs(self.src[start : start + nbytes], heads)
                self.trace("block", tid=tid, layer=layer, i=i, head0=head0, crcs=crcs)

    # ---- peers that go ------------------------------------------------------------------

    def _reclaim(self) -> None:
        """For a while after a worker went: remove the segments of this namespace whose
        process is dead (its KV cache, its channels), as `pdhal cleanup` would."""
        now = time.monotonic()
        if now > self._reclaim_until or now < self._next_reclaim:
            return
        self._next_reclaim = now + RECLAIM_EVERY_S
        removed, _ = pdhal.cleanup(pdhal.namespace())
        if removed:
            self.trace("reclaimed", paths=removed)
            print(
                f"pdhal-vllm messager: removed {len(removed)} segment(s) a dead worker left: "
                f"{', '.join(removed)}",
                file=sys.stderr,
                flush=True,
            )

    def _gone(self, peer: Peer, why: str) -> None:
        peer.alive = False
        self._reclaim_until = time.monotonic() + RECLAIM_S
        if peer.role == "decode":
            if peer in self.decodes:
                self.decodes.remove(peer)
            # held wants of it fail when their request comes; claimed ones fail now
            for part in [t for t, p in self.claimed.items() if p is peer]:
                self.streamer.fail(part, why)
        elif peer is self.prefill:
            self._end_prefill(why)
        self._report(why)

    def _end_prefill(self, why: str) -> None:
        """The prefill worker is gone: every transfer not ended fails to its decode side."""
        streamer = self.streamer
        streamer.abort(why)
        streamer.close()
        for tid in list(self.added):  # a decode rank that asks for it hears so at once
            self._ended(tid, why)
        self._trace_layers()
        if self.trace.on:
            self.trace("metrics", **streamer.metrics.snapshot())
        self.prefill = self.streamer = self.feed = self.src = None
        self.added.clear()
        self.shards = {}
        self.claimed.clear()
        self.unneeded.clear()

    def _expire_wants(self) -> None:
        """Forget wants no prefill table named within claim_timeout (their decode side ends
        them by its load timeout)."""
        now = time.monotonic()
        for part, (_, _, since) in list(self.wants.items()):
            if now - since > self.claim_timeout:
                self._unserved(part, f"no prefill table named it within {self.claim_timeout:g} s")

    def _report(self, message: str) -> None:
        self.trace("error", error=message)
        print(f"pdhal-vllm messager: {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdhal_vllm.messager",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT for the workers' control connections (port 0: any, printed at start)",
    )
    parser.add_argument("--rank", type=int, default=0, help="the prefill rank this messager serves")
    parser.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="the prefill instance's tensor parallelism (one messager per rank, on ports in a "
        "row from rank 0's)",
    )
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="the decode instances' tensor parallelism (default: --prefill-tp)",
    )
    parser.add_argument(
        "--transport",
        default="shm",
        help="how the blocks reach the decode caches: shm (one host), mooncake, nixl, any "
        "installed transport plugin (the decode workers' 'transport' must be the same)",
    )
    parser.add_argument(
        "--host",
        default=None,
        help="mooncake: the address this host advertises (default: $PDHAL_MOONCAKE_HOST, "
        "else 127.0.0.1)",
    )
    parser.add_argument(
        "--protocol",
        default=None,
        help="mooncake: tcp or rdma (default: $PDHAL_MOONCAKE_PROTOCOL, else tcp)",
    )
    parser.add_argument(
        "--claim-timeout",
        type=float,
        default=120.0,
        help="seconds a transfer may wait for a decode worker to ask for it",
    )
    parser.add_argument("--trace", default=None, help="append JSON-lines events to this file")
    parser.add_argument(
        "--trace-blocks",
        action="store_true",
        help="with --trace: crc32 of every block sent (tests; costly)",
    )
    parser.add_argument("--auth-key", default=None, help="hex key (default: $PDHAL_VLLM_KEY)")
    args = parser.parse_args(argv)
    if args.host:
        os.environ["PDHAL_MOONCAKE_HOST"] = args.host
    if args.protocol:
        os.environ["PDHAL_MOONCAKE_PROTOCOL"] = args.protocol
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: pdhal cleans up
    try:
        messager = Messager(
            args.listen,
            args.rank,
            auth_key(args.auth_key),
            args.transport,
            args.claim_timeout,
            args.trace,
            args.trace_blocks,
            args.prefill_tp,
            args.decode_tp,
        )
    except (ConnectorError, OSError) as exc:
        print(f"pdhal-vllm messager: {exc}", file=sys.stderr)
        return 1
    try:
        messager.serve()
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
