"""The prefill worker: runs the model step by step and posts a layer signal after each layer.

Its KV cache lives in pdhal host memory, shared with the cache messager by set_data_ipc. It
never waits for the messager; it only watches that the messager is alive, so a killed
messager is reported within a layer instead of leaving decode waiting forever.

With tensor parallelism there is one worker per rank, on its own device (it sees only that
one, as its local device 0) and its own channels (named by rank and device id). A worker
computes its rank's heads and MLP units and sums the ranks' partial outputs with its peers
(TpGroup: a socket to each, from the parent), twice a layer, as an all-reduce would.
"""

from __future__ import annotations

import os
import select
import selectors
import signal
import socket
import time
from multiprocessing.connection import wait

import numpy as np

import pdhal
from pdhal import ops
from pdhal_demo.control import DemoError, Outbox
from pdhal_demo.model import TinyDecoder
from pdhal_demo.plan import Plan


class PeerWatch:
    """Knows at once (through a pidfd) when another process has exited."""

    def __init__(self, pid: int, what: str):
        self._fd = os.pidfd_open(pid)
        self._what = f"{what} (pid {pid})"

    def check(self, where: str) -> None:
        if select.select([self._fd], [], [], 0)[0]:
            raise DemoError(f"the {self._what} died; the prefill worker stopped at {where}")

    def fileno(self) -> int:
        """Readable once the process has exited (for multiprocessing.connection.wait)."""
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


class TpGroup:
    """This worker's all-reduce with the other ranks' workers: a connected socket to each
    (socketpairs the parent made), every rank sending its partials to every other."""

    TIMEOUT_S = 60.0

    def __init__(self, rank: int, tp: int, fds: dict[int, int]):
        self.rank, self.tp = rank, tp
        self.peers = {peer: socket.socket(fileno=fd) for peer, fd in fds.items()}
        for sock in self.peers.values():
            sock.setblocking(False)
        self._selector = selectors.DefaultSelector()

    def _exchange(self, data: bytes) -> dict[int, bytes]:
        """Send `data` to every peer and receive as many bytes from each, at once (each
        side sending first would deadlock once a message outgrows the socket buffers)."""
        unsent = {peer: memoryview(data) for peer in self.peers}
        got = {peer: bytearray(len(data)) for peer in self.peers}
        filled = dict.fromkeys(self.peers, 0)
        for peer, sock in self.peers.items():
            self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, peer)
        try:
            while any(unsent.values()) or any(n < len(data) for n in filled.values()):
                events = self._selector.select(self.TIMEOUT_S)
                if not events:
                    raise DemoError(
                        f"rank {self.rank}'s peers sent nothing for "
                        f"{self.TIMEOUT_S:.0f} s in an all-reduce"
                    )
                for key, mask in events:
                    peer, sock = key.data, key.fileobj
                    if mask & selectors.EVENT_WRITE and unsent[peer]:
                        unsent[peer] = unsent[peer][sock.send(unsent[peer]) :]
                    if mask & selectors.EVENT_READ and filled[peer] < len(data):
                        n = sock.recv_into(memoryview(got[peer])[filled[peer] :])
                        if n == 0:
                            raise DemoError(
                                f"the worker of rank {peer} is gone (its "
                                f"all-reduce connection closed)"
                            )
                        filled[peer] += n
                    want = (selectors.EVENT_WRITE if unsent[peer] else 0) | (
                        selectors.EVENT_READ if filled[peer] < len(data) else 0
                    )
                    if want:
                        self._selector.modify(sock, want, peer)
                    else:
                        self._selector.unregister(sock)
        finally:
            for sock in self.peers.values():
                if sock in self._selector.get_map():
                    self._selector.unregister(sock)
        return {peer: bytes(buf) for peer, buf in got.items()}

    def reduce(self, parts: dict[int, list]) -> list:
        """model.forward's reduce: this rank's per-chunk partials -> the ranks' sums."""
        import paddle

        mine = parts[self.rank]
        if self.tp == 1:
            return mine
        rows = [int(p.shape[0]) for p in mine]
        local = np.concatenate([p.numpy() for p in mine])
        received = self._exchange(local.tobytes())
        total = None
        for rank in range(self.tp):  # rank order, as the decode side sums
            part = (
                local
                if rank == self.rank
                else np.frombuffer(received[rank], np.float32).reshape(local.shape)
            )
            part = paddle.to_tensor(part)
            total = part if total is None else total + part
        return list(paddle.split(total, rows)) if len(rows) > 1 else [total]

    def close(self) -> None:
        self._selector.close()
        for sock in self.peers.values():
            sock.close()


def _inject(fault: str, out: Outbox, pids: dict[str, int]) -> None:
    """The fault demos: SIGKILL the messager, the decoder or this worker half-way through
    step 0."""
    victim = fault.removeprefix("kill-")
    out.send("fault", {"victim": victim, "at": time.monotonic_ns()})
    os.kill(pids[victim], signal.SIGKILL)


def run(link, setup: dict) -> None:
    import paddle

    plan = Plan.from_json(setup["plan"])
    rank, layers, tp = setup["rank"], plan.model.layers, plan.tp
    # This process sees one device, its rank's, as local device 0: its channels are named
    # by that device's physical index, the same in the messager (which sees every device).
    device = pdhal.current_platform().device_index(0)
    model = TinyDecoder(plan.model, tp, [rank])
    group = TpGroup(rank, tp, {int(p): int(fd) for p, fd in setup["tp_fds"].items()})
    prompts = plan.prompts()
    shape = plan.model.cache_shape(plan.prefill_cache_blocks, tp)
    buffer = ops.host_alloc(int(np.prod(shape)) * 4)
    cache = buffer.as_numpy(np.float32, shape)
    ops.set_data_ipc(paddle.from_dlpack(cache), setup["cache_name"])
    # The warm-up step an engine's profile run would be: it creates the per-query channel.
    ops.open_shm_and_get_meta_signal(rank, device)
    link.send(("ready", {"device": device, "backend": pdhal.current_backend()}))

    _, go = link.recv()
    watch = PeerWatch(go["messager_pid"], "cache messager")
    out = Outbox(link)
    fault = setup.get("fault") if rank == 0 else None  # SIGKILL a process mid first step
    freed: set[int] = set()  # requests every rank's messager has sent: their blocks are free
    for index, step in enumerate(plan.steps):
        # A step that reuses blocks of earlier requests starts once those are sent.
        while not freed.issuperset(plan.step_waits[index]):
            if link not in wait([link, watch]):
                watch.check(f"step {index}, waiting for blocks to come free")
            kind, message = link.recv()
            if kind == "exit":  # the run failed elsewhere
                return
            freed.add(message["request"])  # ("freed", ...)
        if plan.mode == "per_query":
            meta = ops.open_shm_and_get_meta_signal(rank, device)
            signal_of, channel_step = (lambda i: ops.init_signal_layerwise(meta, i)), meta.step
        else:
            encoder, cached = [0] * plan.max_batch, [0] * plan.max_batch
            for c in step:
                slot = plan.request(c.request).slot
                encoder[slot], cached[slot] = c.length, c.start
            chunk = ops.init_kv_signal_per_query(encoder, encoder, cached, rank, layers, device)
            signal_of, channel_step = chunk.layer, chunk.step
        chunks = plan.chunks(step, prompts, "prefill")
        started = time.monotonic_ns()

        def after_layer(layer: int) -> None:
            # The layer's end is read before its signal: the messager may start its transfer
            # the moment the signal lands, and no transfer may seem to start before its
            # layer was done (exposed transfer >= 0 rests on it). It is also the time the
            # layer was signalled, from which a request's exposed transfer is measured.
            end = time.monotonic_ns()
            event = {"rank": rank, "step": channel_step, "index": index, "layer": layer, "end": end}
            if not plan.signal_at_end:
                ops.signal_layer_ready(signal_of(layer))
                event["signal"] = time.monotonic_ns()  # posted (the timeline's ticks)
            out.post("layer", event)
            if fault and index == 0 and layer == layers // 2:
                _inject(
                    fault,
                    out,
                    {
                        "messager": go["messager_pid"],
                        "worker": os.getpid(),
                        "decoder": go.get("decoder_pid"),
                    },
                )
            out.due()
            watch.check(f"step {index} layer {layer}")

        out.post("step", {"rank": rank, "step": channel_step, "index": index, "start": started})
        first_tokens = model.forward(chunks, {rank: cache}, after_layer, group.reduce)
        if plan.signal_at_end:
            signalled = time.monotonic_ns()  # read before the first signal, as above
            for layer in range(layers):
                ops.signal_layer_ready(signal_of(layer))
            out.post(
                "signals",
                {
                    "rank": rank,
                    "step": channel_step,
                    "signalled": signalled,
                    "at": time.monotonic_ns(),  # every one posted (the timeline's ticks)
                },
            )
        for request, token in first_tokens.items():
            out.post("first_token", {"rank": rank, "request": request, "token": token})
        out.flush()
    link.send(("done", {}))
    # Wait for ("exit", {}): the messager has sent everything. It may die before that, too.
    while True:
        if link not in wait([link, watch]):
            watch.check("the end of the prefill, before the messager had sent everything")
        if link.recv()[0] == "exit":  # not ("freed", ...)
            break
    watch.close()
    group.close()
    ops.host_free(buffer)
