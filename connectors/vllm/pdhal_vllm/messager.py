"""The cache messager of one prefill rank: `python -m pdhal_vllm.messager --listen HOST:PORT`.

It serves the prefill worker's KV to the decode workers with a pdhal.transfer.PrefillService
at --listen: the decode workers claim each request there (pdhal's session protocol,
docs/session-protocol.md), and the service's KVStreamer writes each layer's blocks into
their caches (--transport: shm on one host, mooncake or nixl across hosts) while the next
layers compute. The prefill worker connects over a local socket named by that address
(wire.worker_address) and says hello with its KV cache (shared memory) and its layout; the
messager then makes the service over that cache, one per prefill worker (a restarted worker
gets a new one at the same address). That socket takes only processes of the messager's own
user that prove they hold the deployment's key, each within its own bound (wire.WorkerLink),
and what they send is checked to be a worker's message before it is used. Per step, the
worker sends the step's table (transfer id, its blocks, the tokens the step wrote) before
the step's first layer signal: a request
is the service's once its table first names it, and the table and the layer signals (read
through pdhal: a futex wait, never a sleep loop) drive the service through
pdhal.transfer.PerQueryFeed. Each transfer's end goes back to the worker ("sent" or
"failed"), which then frees its blocks.

Tensor parallelism (--prefill-tp P; one messager per prefill rank, listening on consecutive
ports): each decode rank claims its part from each prefill rank holding heads it holds,
whatever its own split (the service makes the part when the decode side says its split).

Failures end transfers, never wait on them: a dead prefill worker (pdhal sees its channel's
lock drop, or its connection closes) aborts and closes the service, which fails every
transfer not ended on both sides; decode sides that go, cancel, or never claim are the
service's to end (its sessions, its claim lease). Once a worker it served on this host
exits (woken by its pidfd), the segments dead processes left in this namespace are removed,
as `pdhal cleanup` would: vLLM kills its workers outright, so they cannot.
"""

from __future__ import annotations

import argparse
import collections
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import numpy  # noqa: F401 (see Messager.__init__)

import pdhal
from pdhal import PdhalError, ProducerDiedError, SignalTimeoutError, ops, transfer
from pdhal.transfer import CacheLayout, CacheSpec, PerQueryFeed, PrefillService
from pdhal_vllm.wire import (
    HANDSHAKE_S,
    KEEPALIVE_S,
    ConnectorError,
    Tracer,
    WorkerLink,
    auth_key,
    checked_seconds,
    listen_workers,
    peer_process,
    reserve,
    transport_options,
)

#: Device ids a layer-signal channel can be named by: [0, DEVICES)
DEVICES = 1 << 20
#: Transfer ids of ended transfers kept, so a later table entry of one is not added again.
ENDED = 10000
#: Connections that have not said their hello yet, at most (each has HANDSHAKE_S to): more
#: are closed at once, so a flood of silent ones (from this user's processes: no other
#: user's is taken) costs a bounded number of threads.
GREETING = 512


class PrefillWorker:
    """The connected prefill worker: its link, its process (as the kernel knows it) and
    its hello. What the messager tells it is written by a thread of its own, so a worker
    that does not read holds up nothing but itself (dropped once it read nothing for
    KEEPALIVE_S)."""

    def __init__(self, link: WorkerLink, pid: int, hello: dict):
        self.link, self.pid, self.hello = link, pid, hello
        self.alive = True
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages, then None: close
        threading.Thread(target=self._write, name="pdhal-vllm-to-worker", daemon=True).start()

    @property
    def device(self) -> int:
        """The physical device its layer-signal channel is named by."""
        return self.hello["device"]

    def send(self, *message) -> None:
        """Tell the worker `message` (never blocks)."""
        if self.alive:
            self._outbox.put(message)

    def close(self) -> None:
        """Close its link once what was sent so far is written."""
        self.alive = False
        self._outbox.put(None)

    def end(self) -> None:
        """Close its link now (it went, or broke it)."""
        self.close()
        self.link.close()

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.link.send(*message)
            except ConnectorError:  # it went, or read nothing: its reader says so
                self.alive = False
                break
        self.link.close()


@dataclass
class Added:
    """A transfer the service has: its prompt's length and the source blocks given so far."""

    prompt: int
    blocks: list[int]


class _Feed:
    """The service as PerQueryFeed drives it: each layer through the messager's
    give_layer."""

    def __init__(self, messager: Messager, service: PrefillService):
        self.layout = service.layout
        self._messager, self._service = messager, service

    def layer_ready(self, layer: int, ready, signal_ns=None, *, step=None) -> None:
        self._messager.give_layer(self._service, layer, ready, signal_ns, step)


#: The fields of a table entry.
ENTRY_FIELDS = ("tid", "blocks", "start", "end", "prompt_len")


def _count(value) -> bool:
    return type(value) is int and value >= 0


def _tids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, str) and t for t in value)


def _entry(value) -> bool:
    """Whether `value` is a table entry: a transfer id, its block ids, the tokens the step
    wrote ([start, end), at least one) and the prompt's length (at least one)."""
    return (
        isinstance(value, dict)
        and all(k in value for k in ENTRY_FIELDS)
        and isinstance(value["tid"], str)
        and bool(value["tid"])
        and isinstance(value["blocks"], list)
        and all(_count(b) for b in value["blocks"])
        and all(_count(value[k]) for k in ("start", "end", "prompt_len"))
        and value["start"] < value["end"]
        and value["prompt_len"] >= 1
    )


#: A prefill worker's hello: its fields that are counts (ints >= 0); and "cache", the name
#: its KV cache is shared as, "layers", per layer its caches' pdhal.transfer.CacheSpec words
#: (checked by CacheSpec.from_json), and "tokens_placed", whether they say where each token
#: of a block is (else a decode instance of another block size is refused).
HELLO_COUNTS = ("rank", "ranks", "device", "kv_heads", "nbytes", "block_size")


def _hello_problem(hello: dict) -> str | None:
    """What is wrong with the fields of a prefill worker's hello, or None."""
    for key in (*HELLO_COUNTS, "cache", "layers", "tokens_placed"):
        if key not in hello:
            return f"its hello has no {key!r}"
    for key in HELLO_COUNTS:
        if not _count(hello[key]):
            return f"its hello's {key} must be an int >= 0, got {hello[key]!r:.80}"
    if not isinstance(hello["cache"], str) or not 0 < len(hello["cache"]) <= 255:
        return f"its hello's cache must be a name of 1-255 characters, got {hello['cache']!r:.80}"
    if not isinstance(hello["layers"], list) or not all(
        isinstance(layer, list) for layer in hello["layers"]
    ):
        return f"its hello's layers must be a list of lists, got {hello['layers']!r:.80}"
    if not isinstance(hello["tokens_placed"], bool):
        return (
            f"its hello's tokens_placed must be true or false, got {hello['tokens_placed']!r:.80}"
        )
    return None


def _table(items) -> bool:
    """Whether `items` are a table's: its step, then its entries."""
    return (
        len(items) == 2
        and _count(items[0])
        and isinstance(items[1], list)
        and all(_entry(e) for e in items[1])
    )


#: What a prefill worker sends after its hello: kind -> whether its items are that kind's.
WORKER_SENDS = {
    "table": _table,
    "failed": lambda items: len(items) == 1 and _tids(items[0]),
    "abandon": lambda items: len(items) == 1 and _tids(items[0]),
}


class Messager:
    def __init__(
        self,
        listen: str,
        rank: int,
        key: bytes,
        transport: str,
        claim_timeout: float,
        keepalive: float,
        trace: str | None,
        prefill_ranks: int = 1,
        transport_options: dict | None = None,
    ):
        if transport not in transfer.transports():  # any installed plugin (pdhal info)
            raise ConnectorError(
                f"transport {transport!r} is not installed; installed: "
                f"{', '.join(transfer.transports())}"
            )
        try:
            transfer.transport(transport).configure(**(transport_options or {}))
        except PdhalError as exc:
            raise ConnectorError(f"--transport-option: {exc}") from None
        if not 0 <= rank < prefill_ranks:
            raise ConnectorError(f"--rank must be in [0, {prefill_ranks}) (--prefill-tp)")
        checked_seconds(claim_timeout, "--claim-timeout")
        checked_seconds(keepalive, "--keepalive")
        # What serving a worker's hello needs is loaded before this messager says it
        # listens, not in that hello: the platform's backend, and numpy (imported above),
        # through which the cpu platform maps the worker's cache. A messager restarted
        # under a live worker on a loaded host took 8 s loading them there, and every
        # request meanwhile failed for want of a messager.
        pdhal.current_platform()
        self.rank, self.prefill_ranks = rank, prefill_ranks
        self.key, self.transport, self.claim_timeout = key, transport, claim_timeout
        self.keepalive = keepalive
        self.trace = Tracer(trace)
        self.events: queue.Queue = queue.Queue()
        self.prefill: PrefillWorker | None = None
        self.service: PrefillService | None = None
        self.feed: PerQueryFeed | None = None
        self.block_size = 0
        self.added: dict[str, Added] = {}  # transfer id -> the request in the service
        #: transfer id -> "" (sent) or why it failed, for the last ENDED transfers
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._mark = 0  # trace: the streamer's metrics.layers_since cursor
        self._watched: set[int] = set()  # worker pids whose exit is awaited (reclaim)
        self._port, self.address = reserve(listen)  # each prefill worker's service listens there
        self.listener = listen_workers(self.address)

    # ---- connections --------------------------------------------------------------------

    def serve(self) -> None:
        threading.Thread(target=self._accept, name="pdhal-vllm-accept", daemon=True).start()
        print(
            f"pdhal-vllm messager rank {self.rank} of {self.prefill_ranks} listening on "
            f"{self.address}",
            flush=True,
        )
        self.trace("listening", address=self.address, transport=self.transport)
        self._reclaim()  # what a killed run left
        while True:
            event = self.events.get()  # (a wake per event, nothing ticks)
            try:
                self._handle(event)
                self._trace_layers()
            except (ConnectorError, PdhalError) as exc:
                self._report(str(exc))
            except Exception:  # a bug: say so, and keep serving the other transfers
                self._report(traceback.format_exc())

    def _accept(self) -> None:
        """Each connection of this user's processes to its own reader (none waits on
        another's handshake); another user's is closed at once."""
        greeting = threading.BoundedSemaphore(GREETING)
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError as exc:  # out of descriptors: they come back as links end
                self.trace("refused", error=f"accepting failed: {exc}")
                time.sleep(0.1)
                continue
            pid, uid = peer_process(sock)
            if uid != os.getuid():
                why = f"process {pid} of user {uid}, not this one's"
            elif not greeting.acquire(blocking=False):
                why = f"process {pid}: {GREETING} connections are saying hello already"
            else:
                try:
                    threading.Thread(
                        target=self._read, args=(sock, pid, greeting), daemon=True
                    ).start()
                    continue
                except RuntimeError as exc:  # no thread to be had: this one waits for none
                    greeting.release()
                    why = f"process {pid}: {exc}"
            self.trace("refused", error=why)
            sock.close()

    def _read(self, sock, pid: int, greeting: threading.BoundedSemaphore) -> None:
        """Process `pid`'s connection: the key proven and its hello, each within
        HANDSHAKE_S, then its messages, each checked to be one a worker sends (WORKER_SENDS);
        anything else ends that connection alone, and the messager serves on."""
        try:
            link, hello = self._greet(sock, pid)
        finally:
            greeting.release()
        if link is None:
            return
        worker = PrefillWorker(link, pid, hello)
        self.events.put(("hello", worker))
        why = f"the prefill worker (pid {pid}) went"
        try:
            while True:
                message = link.receive()
                check = WORKER_SENDS.get(message[0])
                if check is None or not check(message[1:]):
                    why = f"the prefill worker (pid {pid}) sent {message!r:.80}: not a message"
                    break
                self.events.put((message[0], worker, *message[1:]))
        except ConnectorError as exc:
            why = f"the prefill worker (pid {pid}) went: {exc}"
        finally:  # whatever ended it: the worker is gone, and the loop hears so
            worker.end()
            self.events.put(("gone", worker, why))

    def _greet(self, sock, pid: int) -> tuple[WorkerLink | None, dict]:
        """The link of process `pid` and its hello, or (None, {}) once refused (traced)."""
        try:
            link = WorkerLink.accepted(sock, self.key)
        except ConnectorError as exc:
            self.trace("refused", error=f"process {pid}: {exc}")
            return None, {}
        try:
            hello = link.receive(HANDSHAKE_S)
            if hello is None or hello[0] != "hello" or len(hello) != 2:
                raise ConnectorError(f"its first message must be its hello, got {hello!r:.80}")
            if not isinstance(hello[1], dict):
                raise ConnectorError(f"its hello must be an object, got {hello[1]!r:.80}")
        except ConnectorError as exc:
            self.trace("refused", error=f"process {pid}: {exc}")
            link.close()
            return None, {}
        return link, hello[1]

    def _watch(self, worker: PrefillWorker) -> None:
        """The pdhal reader of the prefill worker's layer signals: one event per wake-up."""
        try:
            reader = ops.open_kv_signal_reader(self.rank, worker.device, timeout=30.0)
        except PdhalError as exc:
            self.events.put(
                ("gone", worker, f"the prefill worker has no layer-signal channel: {exc}")
            )
            return
        seen = reader.wait((0, -1), timeout=30.0)  # the worker's opening step
        self.events.put(("progress", worker, seen, time.monotonic_ns()))
        while worker.alive:
            try:
                seen = reader.wait(seen, timeout=1.0)
            except SignalTimeoutError:
                continue
            except ProducerDiedError as exc:
                self.events.put(("gone", worker, f"the prefill worker died: {exc}"))
                break
            self.events.put(("progress", worker, seen, time.monotonic_ns()))
        reader.close()

    # ---- events -------------------------------------------------------------------------

    def _handle(self, event: tuple) -> None:
        kind, rest = event[0], event[1:]
        if kind == "outcome":
            self._outcome(*rest)
            return
        if kind == "decode_gone":  # its segments, if it was killed outright, are ours to remove
            facts, why = rest  # (its transfers not ended failed: their outcomes say so)
            self.trace("decode_gone", peer_pid=facts.pid, host=facts.host, why=why)
            if facts.host == socket.gethostname():
                self._reclaim_after(facts.pid)
            return
        if kind == "exited":
            self._watched.discard(rest[0])
            self._reclaim()
            return
        worker = rest[0]
        if kind == "hello":
            self._hello(worker)
        elif worker is not self.prefill:
            return  # a refused or replaced worker's
        elif kind == "table" and self.feed is not None:
            _, step, entries = rest
            self.trace("table", step=step, tids=[e["tid"] for e in entries])
            for entry in entries:
                self._add(entry)
            try:
                self.feed.step(step, [(e["tid"], e["end"]) for e in entries])
            except PdhalError as exc:  # (a step it gave already): a worker that is broken
                self._end_prefill(f"the prefill worker (pid {worker.pid}) sent a table: {exc}")
        elif kind == "failed" and self.service is not None:  # while no messager was there
            why = "the cache messager was gone (restarted since)"
            for tid in rest[1]:
                if tid not in self.added:
                    self._remember(tid, why)
                    self.service.fail(tid, why)  # a decode rank claiming it hears so at once
        elif kind == "abandon" and self.service is not None:
            for tid in rest[1]:
                if tid not in self.ended:  # (its outcome tells the prefill worker)
                    self.service.fail(tid, "vLLM ended the prefill request (aborted, or an error)")
        elif kind == "progress" and self.feed is not None:
            _, seen, t = rest
            self.trace("seen", step=seen[0], layer=seen[1], t=t)
            self.feed.progress(tuple(seen), t)
        elif kind == "gone":
            self._end_prefill(rest[1])

    def _hello(self, worker: PrefillWorker) -> None:
        hello = worker.hello
        self.trace("hello", role="prefill", peer_pid=worker.pid)
        problem = _hello_problem(hello)
        if problem is not None:
            self._refuse(worker, problem)
            return
        if hello["ranks"] != self.prefill_ranks or hello["rank"] != self.rank:
            self._refuse(
                worker,
                f"this messager serves prefill rank {self.rank} of tensor parallelism "
                f"{self.prefill_ranks} (--rank, --prefill-tp); the prefill worker is rank "
                f"{hello['rank']} of {hello['ranks']}",
            )
            return
        if hello["device"] >= DEVICES:
            self._refuse(
                worker,
                f"the prefill worker's device must be an int in [0, {DEVICES}), got "
                f"{hello['device']}",
            )
            return
        if self.prefill is not None and self.prefill.alive:
            self._refuse(worker, "this messager already serves a prefill worker")
            return
        if self.prefill is not None:  # gone, its "gone" not handled yet
            self._end_prefill(f"the prefill worker (pid {self.prefill.pid}) was replaced")
        try:  # (the worker shared its cache before its hello: no waiting for it)
            src = ops.share_external_data("uint8", hello["cache"], [hello["nbytes"]], timeout=0)
            layout = CacheLayout(
                [src],
                [
                    [
                        CacheSpec.from_json(words, f"the prefill worker's layer {index}")
                        for words in layer
                    ]
                    for index, layer in enumerate(hello["layers"])
                ],
            )
            service = PrefillService(
                layout,
                hello["block_size"],
                key=self.key,
                kv_heads=hello["kv_heads"],
                tp_rank=self.rank,
                tp_size=self.prefill_ranks,
                listen=self.address,
                claim_timeout=self.claim_timeout,
                keepalive=self.keepalive,
                transport_name=self.transport,
                on_outcome=lambda outcome: self.events.put(("outcome", outcome)),
                on_session_end=lambda facts, why: self.events.put(("decode_gone", facts, why)),
                # where the worker does not know how vLLM packs its blocks (cpu_layout),
                # a decode instance of another --block-size is refused at its hello
                same_block_size=not hello["tokens_placed"],
            )
        except (PdhalError, TypeError, ValueError) as exc:
            why = f"the messager cannot stream from this prefill cache: {exc}"
            self._refuse(worker, why[:400])
            return
        self.prefill, self.service = worker, service
        self.block_size = hello["block_size"]
        self.feed = PerQueryFeed(_Feed(self, service))
        self._mark = 0
        threading.Thread(
            target=self._watch, args=(worker,), name="pdhal-vllm-reader", daemon=True
        ).start()
        worker.send("ready", {"address": self.address, "prefill_ranks": self.prefill_ranks})
        self.trace("ready", peer_pid=worker.pid)

    def _refuse(self, worker: PrefillWorker, why: str) -> None:
        """Tell `worker` why it is not served, and drop its connection."""
        worker.send("error", why)
        worker.close()
        self._report(f"refused the prefill worker (pid {worker.pid}): {why}")

    # ---- requests -----------------------------------------------------------------------

    def _add(self, entry: dict) -> None:
        """Give the service the request of a table entry, or the blocks its table names
        that the service does not have yet (vLLM allocates a chunked prompt's blocks chunk
        by chunk: each layer's blocks go once their tokens and their ids are there)."""
        tid = entry["tid"]
        if tid in self.ended:
            return
        prompt = entry["prompt_len"]
        blocks = entry["blocks"][: -(-prompt // self.block_size)]  # the prompt's only
        added = self.added.get(tid)
        try:
            if added is None:
                self.service.add_request(tid, blocks, prompt)
                self.added[tid] = Added(prompt, list(blocks))
            elif len(blocks) > len(added.blocks) and self.service.sends:
                self.service.add_blocks(tid, blocks[len(added.blocks) :])
                added.blocks = list(blocks)
        except PdhalError as exc:
            why = f"the messager cannot stream it: {exc}"
            self.service.fail(tid, why)  # (its outcome comes from the service if it has it)
            if added is None:
                self.added[tid] = Added(prompt, list(blocks))
                self._outcome(transfer.Outcome(tid, False, why))

    def give_layer(self, service: PrefillService, layer: int, ready, signal_ns, step) -> None:
        """Give `service` `layer` of the (transfer id, tokens) in `ready` (PerQueryFeed's
        call, on each layer signal), traced."""
        service.layer_ready(layer, ready, signal_ns, step=step)
        if self.trace.on:
            now = time.monotonic_ns()
            for tid, _ in ready:
                if tid in self.added:
                    self.trace("read", tid=tid, layer=layer, t=now)

    # ---- outcomes -----------------------------------------------------------------------

    def _outcome(self, outcome: transfer.Outcome) -> None:
        """A transfer ended (the service's on_outcome, through the event queue): the
        prefill worker hears it, and frees its blocks."""
        tid = outcome.request_id
        added = self.added.pop(tid, None)
        if added is None:
            return  # (its prefill worker went: ended then)
        why = "" if outcome.landed else outcome.reason or "failed"
        self._remember(tid, why)
        if outcome.landed:
            self.trace("sent", tid=tid)
            self.prefill.send("sent", tid)
            return
        self._report(f"transfer {tid}: {why}")
        self.prefill.send("failed", tid, why)

    def _remember(self, tid: str, why: str) -> None:
        self.ended[tid] = why
        while len(self.ended) > ENDED:
            self.ended.popitem(last=False)

    def _trace_layers(self) -> None:
        """The streamer's per-layer numbers since the last call, as "landed" events."""
        if not self.trace.on or self.service is None:
            return
        records, self._mark = self.service.streamer.metrics.layers_since(self._mark)
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

    # ---- workers that go ----------------------------------------------------------------

    def _reclaim_after(self, pid: int) -> None:
        """Once process `pid` (a worker on this host) exits, reclaim: woken by its pidfd on
        a thread of its own (a live worker's thread waits as long as it lives)."""
        if pid in self._watched:
            return
        self._watched.add(pid)
        threading.Thread(
            target=self._await_exit, args=(pid,), name="pdhal-vllm-reclaim", daemon=True
        ).start()

    def _await_exit(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # exited already (or not a process this one may watch)
            fd = None
        if fd is not None:
            waiter = select.poll()
            waiter.register(fd, select.POLLIN)
            waiter.poll()  # readable once it exited
            os.close(fd)
        self.events.put(("exited", pid))

    def _reclaim(self) -> None:
        """Remove the segments of this namespace whose process is dead (a KV cache,
        channels), as `pdhal cleanup` would."""
        removed, _ = pdhal.cleanup(pdhal.namespace())
        if removed:
            self.trace("reclaimed", paths=removed)
            print(
                f"pdhal-vllm messager: removed {len(removed)} segment(s) a dead worker left: "
                f"{', '.join(removed)}",
                file=sys.stderr,
                flush=True,
            )

    def _end_prefill(self, why: str) -> None:
        """The prefill worker is gone: its service fails every transfer not ended (on both
        sides) and closes; a decode rank that claims one of them later hears so at once."""
        self.prefill.close()
        self._report(why)
        service = self.service
        if service is not None:
            service.abort(why)
            service.close()
            self._trace_layers()
            if self.trace.on:
                self.trace("metrics", **service.streamer.metrics.snapshot())
        for tid in self.added:
            self._remember(tid, why)
        gone = self.prefill.pid
        self.prefill = self.service = self.feed = None
        self.added.clear()
        self._reclaim_after(gone)

    def _report(self, message: str) -> None:
        self.trace("error", error=message)
        print(f"pdhal-vllm messager: {message}", file=sys.stderr, flush=True)


def main(argv=None, messager_class: type[Messager] = Messager) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdhal_vllm.messager",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT where the decode workers claim their KV (port 0: a free one, chosen at "
        "start and printed); the prefill worker's `messager` names it too",
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
        "--transport",
        default="shm",
        help="how the blocks reach the decode caches: shm (one host), mooncake, nixl, any "
        "installed transport plugin (the decode workers' 'transport' must be the same)",
    )
    parser.add_argument(
        "--transport-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of the transport's options, repeated for each (mooncake: host=ADDRESS this "
        "host advertises, protocol=tcp|rdma; `pdhal info` lists each transport's)",
    )
    parser.add_argument(
        "--claim-timeout",
        type=float,
        default=120.0,
        help="seconds a transfer may wait for a decode worker to claim it",
    )
    parser.add_argument(
        "--keepalive",
        type=float,
        default=KEEPALIVE_S,
        help="seconds a decode worker may be silent before its session ends",
    )
    parser.add_argument("--trace", default=None, help="append JSON-lines events to this file")
    parser.add_argument("--auth-key", default=None, help="hex key (default: $PDHAL_VLLM_KEY)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: pdhal cleans up
    try:
        messager = messager_class(
            args.listen,
            args.rank,
            auth_key(args.auth_key),
            args.transport,
            args.claim_timeout,
            args.keepalive,
            args.trace,
            args.prefill_tp,
            transport_options(args.transport_option),
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
