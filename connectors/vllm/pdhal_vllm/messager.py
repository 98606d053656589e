"""The cache messager of one prefill rank: `python -m pdhal_vllm.messager --listen HOST:PORT`.

It reads the prefill worker's layer signals through pdhal (a futex wait, never a sleep loop)
and, for every request the decode side has asked for, writes each finished layer's blocks
into the decode instance's KV cache (shm on one host, Mooncake across hosts), then tells the
decode worker that the layer landed. Block ids come from the connector: the prefill worker
sends each step's table (request, transfer id, its blocks, the tokens the step wrote) before
the step's first layer signal; a decode worker sends the blocks it allocated ("want").

Failures are reported, never waited on: a dead prefill worker (pdhal sees its channel's lock
drop) fails its unfinished transfers to the decode side; a dead decode worker (its connection
drops, or a write to it fails) fails its transfers to the prefill side, which frees the
blocks; a transfer nobody claims within --claim-timeout is failed to both.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener

from pdhal import ops
from pdhal._errors import PdhalError, ProducerDiedError, SignalTimeoutError
from pdhal_vllm.transport import MooncakeEngine, MooncakeWriter, ShmWriter, coalesce
from pdhal_vllm.wire import ConnectorError, Tracer, auth_key, parse_address

FAULT_VAR = "PDHAL_VLLM_MESSAGER_FAULT"  # tests: "exit-after-layers:N" dies mid-transfer


@dataclass
class Peer:
    """A connected worker: its connection and its cache layout."""

    role: str
    conn: Connection
    hello: dict
    lock: threading.Lock = field(default_factory=threading.Lock)
    alive: bool = True
    writer: object = None  # decode peers: the transport writer into its cache

    def send(self, *message) -> None:
        if not self.alive:
            return
        try:
            with self.lock:
                self.conn.send(message)
        except OSError:
            self.alive = False


@dataclass
class Transfer:
    """One request's KV, from the prefill cache to one decode cache."""

    tid: str
    layers: int
    created: float = field(default_factory=time.monotonic)
    prompt_len: int = 0
    src_blocks: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)  # tokens in the prefill cache, per layer
    decode: Peer | None = None
    want: dict | None = None
    sent: list[int] = field(default_factory=list)  # blocks written, per layer
    landed: list[bool] = field(default_factory=list)

    def __post_init__(self):
        self.fit(self.layers)

    def fit(self, layers: int) -> None:
        """Size the per-layer state (a want can come before the prefill said its layers)."""
        if len(self.ready) != layers:
            self.layers = layers
            self.ready, self.sent, self.landed = [0] * layers, [0] * layers, [False] * layers


class Messager:
    def __init__(
        self,
        listen: str,
        rank: int,
        key: bytes,
        host: str,
        protocol: str,
        claim_timeout: float,
        trace: str | None,
        trace_blocks: bool = False,
    ):
        self.rank = rank
        self.host, self.protocol = host, protocol
        self.claim_timeout = claim_timeout
        self.trace = Tracer(trace)
        self.trace_blocks = bool(trace) and trace_blocks
        self.events: queue.Queue = queue.Queue()
        self.prefill: Peer | None = None
        self.src = None  # the prefill cache, mapped
        self.src_base = 0
        self.layout: list[list[int]] = []
        self.block_size = 0
        self.tables: dict[int, list] = {}  # step -> [entries, layers applied]
        self.progress = (0, -1)
        self.transfers: dict[str, Transfer] = {}
        self.failed: dict[str, str] = {}  # transfer id -> why, the most recent failures
        self.mooncake: MooncakeEngine | None = None
        self.layers_written = 0
        fault = os.environ.get(FAULT_VAR, "")
        self.exit_after = (
            int(fault.split(":")[1]) if fault.startswith("exit-after-layers:") else None
        )
        bind = parse_address(listen)
        self.listener = Listener(bind, authkey=key)
        self.address = f"{bind[0]}:{self.listener.address[1]}"

    # ---- connections --------------------------------------------------------------------

    def serve(self) -> None:
        threading.Thread(target=self._accept, name="pdhal-vllm-accept", daemon=True).start()
        print(f"pdhal-vllm messager rank {self.rank} listening on {self.address}", flush=True)
        self.trace("listening", address=self.address)
        while True:
            try:
                event = self.events.get(timeout=0.5)
            except queue.Empty:
                event = ("tick",)
            try:
                self._handle(event)
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
            if peer is self.prefill:
                self.tables[step] = [entries, -1]
                self.trace("table", step=step, tids=[e["tid"] for e in entries])
                self._apply()
        elif kind == "progress":
            _, peer, seen, t = event
            if peer is self.prefill:
                self.trace("seen", step=seen[0], layer=seen[1], t=t)
                self.progress = max(self.progress, tuple(seen))
                self._apply()
        elif kind == "want":
            self._want(event[1], event[2])
        elif kind == "gone":
            self._gone(
                event[1],
                f"the {event[1].role} worker (pid {event[1].hello.get('pid')}) "
                f"closed its connection",
            )
        elif kind == "prefill_died":
            self._gone(event[1], f"the prefill worker died: {event[2]}")
        self._expire()

    def _hello(self, peer: Peer) -> None:
        hello = peer.hello
        self.trace("hello", role=peer.role, peer_pid=hello.get("pid"))
        if peer.role == "prefill":
            if self.prefill is not None and self.prefill.alive:
                peer.send("error", "this messager already serves a prefill worker")
                peer.conn.close()
                return
            try:
                src = ops.share_external_data("uint8", hello["cache"], [hello["nbytes"]])
            except (PdhalError, KeyError) as exc:
                peer.send("error", f"the messager cannot map the prefill cache: {exc}")
                peer.alive = False
                raise ConnectorError(
                    f"cannot map the prefill cache of pid {hello.get('pid')}: {exc}"
                ) from None
            self.prefill = peer
            self.src = src
            self.src_base = self.src.ctypes.data
            self.layout = hello["layers"]
            self.block_size = hello["block_size"]
            self.tables.clear()
            self.progress = (0, -1)
            if self.mooncake is not None:
                self.mooncake.register(self.src_base, hello["nbytes"])
            for transfer in self.transfers.values():
                transfer.fit(len(self.layout))
            threading.Thread(
                target=self._watch, args=(peer,), name="pdhal-vllm-reader", daemon=True
            ).start()
            peer.send("ready", {"address": self.address})
            return
        try:  # a decode worker: open the transport into its cache now, once
            describe = hello["endpoint"]
            if describe["transport"] == "shm":
                peer.writer = ShmWriter(describe)
            else:
                engine = self._mooncake()
                peer.writer = MooncakeWriter(engine, describe)
        except (ConnectorError, PdhalError, KeyError) as exc:
            peer.send("error", f"the messager cannot reach this decode cache: {exc}")
            peer.alive = False
            self._report(f"cannot reach decode pid {hello.get('pid')}: {exc}")
            return
        peer.send("ready", {"address": self.address})

    def _mooncake(self) -> MooncakeEngine:
        if self.mooncake is None:
            self.mooncake = MooncakeEngine(self.host, self.protocol)
            if self.src is not None:
                self.mooncake.register(self.src_base, self.src.nbytes)
        return self.mooncake

    def _transfer(self, tid: str) -> Transfer:
        transfer = self.transfers.get(tid)
        if transfer is None:
            transfer = self.transfers[tid] = Transfer(tid, len(self.layout) or 1)
        return transfer

    def _want(self, peer: Peer, want: dict) -> None:
        self.trace("want", tid=want["tid"], blocks=len(want["blocks"]))
        if peer.writer is None:
            peer.send("failed", want["tid"], "the messager has no transport into this cache")
            return
        transfer = self._transfer(want["tid"])
        transfer.decode, transfer.want = peer, want
        self._pump(transfer)

    def _apply(self) -> None:
        """Mark every layer the progress covers ready in its step's transfers, then ship."""
        touched = {}
        num_layers = len(self.layout)
        for step in sorted(self.tables):
            if step > self.progress[0]:
                break
            entries, applied = self.tables[step]
            upto = self.progress[1] if step == self.progress[0] else num_layers - 1
            for layer in range(applied + 1, upto + 1):
                for entry in entries:
                    if entry["tid"] in self.failed:  # its decode side is gone already
                        if layer == 0 and self.prefill is not None:
                            self.prefill.send("failed", entry["tid"], self.failed[entry["tid"]])
                        continue
                    transfer = self._transfer(entry["tid"])
                    transfer.prompt_len = entry["prompt_len"]
                    if len(entry["blocks"]) > len(transfer.src_blocks):
                        transfer.src_blocks = entry["blocks"]
                    transfer.ready[layer] = max(transfer.ready[layer], entry["end"])
                    touched[transfer.tid] = transfer
            self.tables[step][1] = max(applied, upto)
            if upto == num_layers - 1:
                del self.tables[step]
        for transfer in touched.values():
            self._pump(transfer)

    def _pump(self, transfer: Transfer) -> None:
        """Write every layer's newly ready blocks of `transfer`, if its decode side asked."""
        want, decode = transfer.want, transfer.decode
        if (
            want is None
            or not transfer.src_blocks
            or transfer.tid not in self.transfers
            or not self.layout
        ):
            return
        transfer.fit(len(self.layout))
        bs = self.block_size
        dlayout = decode.hello["layers"]
        if (
            decode.hello["block_size"] != bs
            or len(dlayout) != len(self.layout)
            or any(d[2] != p[2] for d, p in zip(dlayout, self.layout))
        ):
            self._fail(
                transfer,
                f"the decode cache does not match the prefill cache (block "
                f"size {decode.hello['block_size']} vs {bs}, layers "
                f"{len(dlayout)} vs {len(self.layout)}, or block bytes)",
            )
            return
        need = want["num_tokens"]
        first = want["first_token"] // bs
        for layer in range(len(self.layout)):
            tokens = min(transfer.ready[layer], need)
            whole = transfer.prompt_len > 0 and tokens >= min(transfer.prompt_len, need)
            end = -(-tokens // bs) if whole else tokens // bs
            start = max(transfer.sent[layer], first)
            if end > start:
                if end > len(want["blocks"]) or end > len(transfer.src_blocks):
                    self._fail(
                        transfer,
                        f"transfer {transfer.tid} needs {end} blocks, the "
                        f"decode side gave {len(want['blocks'])}, the prefill "
                        f"{len(transfer.src_blocks)}",
                    )
                    return
                p_off, p_stride, nbytes = self.layout[layer]
                d_off, d_stride, _ = dlayout[layer]
                runs = coalesce(
                    [
                        (
                            p_off + transfer.src_blocks[i] * p_stride,
                            d_off + want["blocks"][i] * d_stride,
                            nbytes,
                        )
                        for i in range(start, end)
                    ]
                )
                self.trace("read", tid=transfer.tid, layer=layer, first=start, end=end)
                if self.trace_blocks:
                    for i in range(start, end):
                        src = self.src_base + p_off + transfer.src_blocks[i] * p_stride
                        self.trace(
                            "block",
                            tid=transfer.tid,
                            layer=layer,
                            i=i,
                            crc=zlib.crc32(
                                self.src[src - self.src_base : src - self.src_base + nbytes]
                            ),
                        )
                try:
                    decode.writer.write(self.src_base, runs)
                except (ConnectorError, OSError) as exc:
                    self._fail(
                        transfer,
                        f"writing layer {layer} to the decode worker (pid "
                        f"{decode.hello.get('pid')}) failed: {exc}",
                    )
                    return
                transfer.sent[layer] = end if whole else tokens // bs
                self.layers_written += 1
                if self.exit_after is not None and self.layers_written >= self.exit_after:
                    self.trace("fault", what="exit", layers=self.layers_written)
                    os._exit(3)
            if whole and not transfer.landed[layer] and transfer.sent[layer] >= end:
                transfer.landed[layer] = True
                self.trace("landed", tid=transfer.tid, layer=layer)
                decode.send("landed", transfer.tid, layer)
        if all(transfer.landed):
            del self.transfers[transfer.tid]
            self.trace("sent", tid=transfer.tid)
            if self.prefill is not None:
                self.prefill.send("sent", transfer.tid)

    def _fail(self, transfer: Transfer, why: str) -> None:
        self.transfers.pop(transfer.tid, None)
        self.failed[transfer.tid] = why  # a later table entry of it fails at once
        while len(self.failed) > 10000:
            del self.failed[next(iter(self.failed))]
        self._report(f"transfer {transfer.tid}: {why}")
        if transfer.decode is not None:
            transfer.decode.send("failed", transfer.tid, why)
        if self.prefill is not None:
            self.prefill.send("failed", transfer.tid, why)

    def _gone(self, peer: Peer, why: str) -> None:
        peer.alive = False
        if peer.role == "prefill" and peer is self.prefill:
            self.prefill = None
            self.tables.clear()
            for transfer in list(self.transfers.values()):
                if not all(transfer.landed):
                    self._fail(transfer, why)
        elif peer.role == "decode":
            for transfer in list(self.transfers.values()):
                if transfer.decode is peer:
                    self._fail(transfer, why)
        self._report(why)

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer in list(self.transfers.values()):
            if now - transfer.created > self.claim_timeout and (
                transfer.want is None or transfer.prompt_len == 0
            ):
                self._fail(
                    transfer,
                    f"not completed within {self.claim_timeout:.0f} s (no "
                    f"decode asked for it, or no prefill produced it)",
                )

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
        "--host", default="127.0.0.1", help="the address Mooncake advertises for this host"
    )
    parser.add_argument("--protocol", default="tcp", help="Mooncake's protocol (tcp, rdma)")
    parser.add_argument(
        "--claim-timeout",
        type=float,
        default=120.0,
        help="seconds a transfer may wait for its other side",
    )
    parser.add_argument("--trace", default=None, help="append JSON-lines events to this file")
    parser.add_argument(
        "--trace-blocks",
        action="store_true",
        help="with --trace: crc32 of every block read (tests; costly)",
    )
    parser.add_argument("--auth-key", default=None, help="hex key (default: $PDHAL_VLLM_KEY)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: pdhal cleans up
    try:
        messager = Messager(
            args.listen,
            args.rank,
            auth_key(args.auth_key),
            args.host,
            args.protocol,
            args.claim_timeout,
            args.trace,
            args.trace_blocks,
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
