"""The prefill worker: runs the model step by step and posts a layer signal after each layer.

Its KV cache lives in pdhal host memory, shared with the cache messager by set_data_ipc. It
never waits for the messager; it only watches that the messager is alive, so a killed
messager is reported within a layer instead of leaving decode waiting forever.
"""

from __future__ import annotations

import os
import select
import signal
import time
from multiprocessing.connection import wait

import numpy as np

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


def _inject(fault: str, out: Outbox, pids: dict[str, int]) -> None:
    """The fault demos: SIGKILL the messager, the decoder or this worker half-way through
    step 0."""
    victim = fault.removeprefix("kill-")
    out.send("fault", {"victim": victim, "at": time.monotonic_ns()})
    os.kill(pids[victim], signal.SIGKILL)


def run(link, setup: dict) -> None:
    import paddle

    plan = Plan.from_json(setup["plan"])
    rank, layers = setup["rank"], plan.model.layers
    model = TinyDecoder(plan.model)
    prompts = plan.prompts()
    shape = plan.model.cache_shape(plan.prefill_cache_blocks)
    buffer = ops.host_alloc(int(np.prod(shape)) * 4)
    cache = buffer.as_numpy(np.float32, shape)
    ops.set_data_ipc(paddle.from_dlpack(cache), setup["cache_name"])
    # The warm-up step an engine's profile run would be: it creates the per-query channel.
    ops.open_shm_and_get_meta_signal(rank, 0)
    link.send(("ready", {}))

    _, go = link.recv()
    watch = PeerWatch(go["messager_pid"], "cache messager")
    out = Outbox(link)
    fault = setup.get("fault")  # "kill-messager" / "kill-worker": SIGKILL it mid first step
    slots = len(plan.requests)  # batch slot of a request = its id
    for index, step in enumerate(plan.steps):
        if plan.mode == "per_query":
            meta = ops.open_shm_and_get_meta_signal(rank, 0)
            signal_of, channel_step = (lambda i: ops.init_signal_layerwise(meta, i)), meta.step
        else:
            encoder, cached = [0] * slots, [0] * slots
            for c in step:
                encoder[c.request], cached[c.request] = c.length, c.start
            chunk = ops.init_kv_signal_per_query(encoder, encoder, cached, rank, layers)
            signal_of, channel_step = chunk.layer, chunk.step
        chunks = plan.chunks(step, prompts, "prefill")
        started = time.monotonic_ns()

        def after_layer(layer: int) -> None:
            # The layer's end is read before its signal: the messager may start its transfer
            # the moment the signal lands, and no transfer may seem to start before its
            # layer was done (overlap efficiency <= 1 and exposed transfer >= 0 rest on it).
            end = time.monotonic_ns()
            if not plan.signal_at_end:
                ops.signal_layer_ready(signal_of(layer))
            out.post("layer", {"rank": rank, "step": channel_step, "index": index,
                               "layer": layer, "end": end})
            if fault and index == 0 and layer == layers // 2:
                _inject(fault, out, {"messager": go["messager_pid"], "worker": os.getpid(),
                                     "decoder": go.get("decoder_pid")})
            out.due()
            watch.check(f"step {index} layer {layer}")

        out.post("step", {"rank": rank, "step": channel_step, "index": index,
                          "start": started})
        first_tokens = model.forward(chunks, cache, after_layer)
        if plan.signal_at_end:
            for layer in range(layers):
                ops.signal_layer_ready(signal_of(layer))
        for request, token in first_tokens.items():
            out.post("first_token", {"rank": rank, "request": request, "token": token})
        out.flush()
    link.send(("done", {}))
    # Wait for ("exit", {}): the messager has sent everything. It may die before that, too.
    if link not in wait([link, watch]):
        watch.check("the end of the prefill, before the messager had sent everything")
    link.recv()
    watch.close()
    ops.host_free(buffer)
